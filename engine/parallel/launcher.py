"""Rank 0's side: spawn ranks 1..N-1, build its own shard with them, send them each step's commands, and
watch them. Any rank that dies or hangs fails the whole engine (EngineFailure), promptly and loudly.

NOTE: commands travel over one pipe per rank, not a collective: an idle engine then waits as long as it
likes without tripping the collective timeout, and a rank whose rank 0 died reads end-of-file and exits.
The collectives themselves (all-reduce, broadcast, all-gather) carry the timeout `collective_timeout_s`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from datetime import timedelta
from multiprocessing import connection

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.errors import EngineFailure, ModelLoadError
from engine.models.config import ModelConfig
from engine.parallel.rank import (
    RankSpec,
    RankState,
    allocate_cache,
    encode,
    follower_main,
    join_group,
    load_rank,
)
from engine.parallel.validation import check_devices, check_model

log = logging.getLogger(__name__)

# How long a stopping rank may take to leave before it is terminated, then killed.
STOP_GRACE_S = 5.0


class TensorParallelGroup:
    """The ranks of one engine. Only one group per process: torch.distributed's default group is global."""

    def __init__(self, config: EngineConfig, model_path, mc: ModelConfig, device: torch.device,
                 dtype: torch.dtype, max_positions: int) -> None:
        n = config.tensor_parallel_size
        check_model(mc, n, config.weight_bits)
        check_devices(device, n)
        if dist.is_initialized():
            raise ModelLoadError("a tensor-parallel engine is already running in this process; close it first")
        timeout = timedelta(seconds=config.collective_timeout_s)
        store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, timeout=timeout, wait_for_workers=False)
        self.spec = RankSpec(config, str(model_path), mc, device.type, dtype, store.port, max_positions)
        self.failure: EngineFailure | None = None
        self._fail_lock = threading.Lock()  # the watcher and the engine thread may both fail the group
        self._closed = False
        # join_group gives this process (rank 0) its share of the cores; the process gets its own count back
        # when the group ends, so a later engine here does not run (and quantize) on fewer threads.
        self._threads = torch.get_num_threads()
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(1, n):
            ours, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=follower_main, args=(rank, self.spec, theirs), daemon=True,
                               name=f"infinilm-tp-rank{rank}")
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(ours)
        try:
            self._await_all("started")
            join_group(self.spec, 0, store)
            self.state: RankState = load_rank(self.spec, 0)
            self._await_all("loaded")
            allocate_cache(self.spec, self.state, 0)
        except BaseException:
            self._stop_ranks(graceful=False)  # they may be waiting in a rendezvous or collective, not reading
            if dist.is_initialized():
                dist.destroy_process_group()
            torch.set_num_threads(self._threads)
            raise
        self._store = store
        self.state.model.leader = self
        self._wake_r, self._wake_w = os.pipe()
        self._watcher = threading.Thread(target=self._watch, name="tp-watcher", daemon=True)
        self._watcher.start()
        log.info("tensor parallelism: %d ranks (%s), pids %s", n, "nccl" if device.type == "cuda" else "gloo",
                 [os.getpid()] + [p.pid for p in self.procs])

    def _await_all(self, stage: str) -> None:
        """Wait until every rank reports `stage`, or fail at once with the reason of one that could not."""
        waiting = {conn: rank for rank, conn in enumerate(self.conns, 1)}
        while waiting:
            for conn in connection.wait(list(waiting)):  # a rank that exits closes its end: readable too
                rank = waiting[conn]
                try:
                    kind, detail = conn.recv()
                except EOFError:
                    self.procs[rank - 1].join(timeout=1.0)
                    raise ModelLoadError(
                        f"tensor-parallel rank {rank} exited while starting (exit code "
                        f"{self.procs[rank - 1].exitcode}; its log is above). Ranks are spawned and import the "
                        "main module: a script must start the engine under `if __name__ == \"__main__\":`"
                    ) from None
                if kind == "error":
                    raise ModelLoadError(detail)
                if kind != stage:
                    raise ModelLoadError(f"tensor-parallel rank {rank} sent {kind!r}, expected {stage!r}")
                del waiting[conn]

    # ---- rank 0 at work ------------------------------------------------
    def calibrate_kv(self, sequences: list[list[int]], method: str) -> None:
        """Every rank calibrates the fp8 KV scales of its own KV heads on the same sequences, together (their
        forward passes meet in the same collectives)."""
        from engine.quant.kv_scales import calibrate_kv_scales

        self.send(("calibrate_kv", sequences, method))
        with torch.inference_mode():
            calibrate_kv_scales(self.state.model, self.state.kv_caches, sequences, self.spec.config.block_size,
                                method)

    def send(self, message: tuple) -> None:
        """Hand every other rank its next command (called by the model on rank 0: layers.Leader)."""
        self.check()
        payload = encode(message)
        for conn in self.conns:
            try:
                conn.send_bytes(payload)
            except OSError as exc:  # its end of the pipe is closed: it has exited, or is about to
                raise self.fail(exc) from exc

    def check(self) -> None:
        """Raise the group's failure, if a rank has died."""
        if self.failure is not None:
            raise self.failure

    def fail(self, reason: str | BaseException) -> EngineFailure:
        """Mark the group failed (first reason wins), log it once, stop the other ranks; returns the error.
        A failed collective is most often a rank that died: the error then names that rank."""
        if not isinstance(reason, str):
            dead = self._dead_rank(wait_s=1.0)
            reason = (f"{dead}; the step failed with {reason!r}" if dead
                      else f"a tensor-parallel step failed: {reason!r}")
        with self._fail_lock:
            if self.failure is not None:
                return self.failure
            failure = EngineFailure(f"{reason}; the engine cannot continue and must be restarted")
            log.critical("%s", failure)  # before check() can raise it on another thread
            self.failure = failure
        self._stop_ranks(graceful=False)
        return failure

    def _dead_rank(self, wait_s: float = 0.0) -> str | None:
        """The first rank found exited (waiting up to `wait_s` for one), in words; None if all live."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs, 1)}
        ready = connection.wait(list(sentinels), timeout=wait_s)
        if not ready:
            return None
        rank = sentinels[ready[0]]
        proc = self.procs[rank - 1]
        # NOTE: the watcher and the engine thread may both look: the one that reaps the process sets its
        # exit code a moment later, and the other reads None until then.
        deadline = time.monotonic() + 1.0
        while proc.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs, 1)}
        ready = connection.wait([*sentinels, self._wake_r])
        if self._closed or self._wake_r in ready:
            return
        self.fail(self._dead_rank() or "a tensor-parallel rank exited")

    # ---- the end -------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the ranks (politely when the group is healthy) and leave the process group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        os.write(self._wake_w, b"x")
        self._stop_ranks(graceful=self.failure is None)
        self._watcher.join(timeout=STOP_GRACE_S)
        os.close(self._wake_r)
        os.close(self._wake_w)
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self._threads)

    def _stop_ranks(self, graceful: bool = True) -> None:
        """graceful: a stop command first; otherwise (a failed group) SIGKILL at once, since a rank may be
        stopped or stuck in a collective where SIGTERM would wait."""
        if graceful:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(encode(("stop",)))
            for proc in self.procs:
                proc.join(timeout=STOP_GRACE_S)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate() if graceful else proc.kill()
        for proc in self.procs:
            proc.join(timeout=STOP_GRACE_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
