"""What every rank does: join the group, load its shard, agree on the KV pool, and (ranks 1..N-1) run the
commands rank 0 sends until told to stop.

Rank 0 runs these same functions inside the engine's process (launcher.py), so all ranks build their
shard the same way; only the device and the backend (NCCL or gloo) differ between CUDA and the CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import sys
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from engine.attention.kv_int8 import resolve_cache_format
from engine.attention.selection import select_backend, select_int8_backend
from engine.config import CacheLayout, EngineConfig
from engine.kv_cache import allocate_kv_caches, plan_cache_layout
from engine.models.config import ModelConfig
from engine.models.linear import batch_invariant
from engine.parallel.layers import TensorParallelLlama
from engine.parallel.loader import load_shard
from engine.parallel.sharding import ShardPlan
from engine.platform_tuning import PlatformTuning, tune_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSpec:
    """Everything a spawned rank needs to build its shard; pickled into the new process."""

    config: EngineConfig
    model_path: str
    model_config: ModelConfig
    device_type: str  # "cpu" or "cuda"
    dtype: torch.dtype
    store_port: int
    max_positions: int

    @property
    def world_size(self) -> int:
        return self.config.tensor_parallel_size

    def device(self, rank: int) -> torch.device:
        return torch.device("cuda", rank) if self.device_type == "cuda" else torch.device("cpu")


@dataclass
class RankState:
    plan: ShardPlan
    model: TensorParallelLlama
    tuning: PlatformTuning
    layout: CacheLayout | None = None
    kv_caches: list | None = None


def join_group(spec: RankSpec, rank: int, store: dist.Store | None = None) -> None:
    """Join the process group (rank 0 passes the store it hosts). One group per process."""
    device = spec.device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # Each rank gets its share of the cores unless num_threads says otherwise.
        torch.set_num_threads(spec.config.num_threads or max(1, (os.cpu_count() or 1) // spec.world_size))
    timeout = timedelta(seconds=spec.config.collective_timeout_s)
    if store is None:
        store = dist.TCPStore("127.0.0.1", spec.store_port, spec.world_size, is_master=False, timeout=timeout)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=spec.world_size, timeout=timeout)


def load_rank(spec: RankSpec, rank: int) -> RankState:
    """The rank's shard, loaded and fitted to the machine (no fused one-call decoder: layers.py)."""
    config, mc, device = spec.config, spec.model_config, spec.device(rank)
    plan = ShardPlan.for_rank(mc, rank, spec.world_size)
    local = plan.local_config(mc)
    if config.cache_bits == 8:
        backend = select_int8_backend(config.attention_backend, device, local.num_heads, local.num_kv_heads,
                                      local.head_dim, resolve_cache_format(config.cache_format, device),
                                      config.kv_key_rotation)
    else:
        backend = select_backend(config.attention_backend, device, local.num_heads, local.num_kv_heads,
                                 local.head_dim, config.block_size)
    dummy = config.load_format == "dummy"
    model = load_shard(None if dummy else spec.model_path, mc, plan, backend, spec.max_positions, spec.dtype,
                       device, seed=config.seed if dummy else None)
    tuning = tune_model(model, config, device, spec.dtype)
    model.install_row_parallel_hooks()  # tuning may have swapped modules; hooks go on what runs
    return RankState(plan, model, tuning)


def allocate_cache(spec: RankSpec, state: RankState, rank: int) -> None:
    """Every rank's pool gets the same number of blocks, the fewest any rank's memory allows (a collective):
    the block tables rank 0 hands out must be valid on every rank."""
    device = spec.device(rank)
    local = state.plan.local_config(spec.model_config)
    layout = plan_cache_layout(spec.config, local, device, spec.dtype)
    blocks = torch.tensor([layout.num_blocks], dtype=torch.int64, device=device)
    dist.all_reduce(blocks, op=dist.ReduceOp.MIN)
    agreed = int(blocks.item())
    state.layout = dataclasses.replace(layout, num_blocks=agreed,
                                       max_model_len=min(layout.max_model_len, agreed * layout.block_size))
    state.kv_caches = allocate_kv_caches(state.layout, local, huge_pages=spec.config.huge_pages is True)


# ---- the messages rank 0 sends: tensors travel as numpy arrays, rebuilt on the receiving rank's device ----
@dataclass
class _Array:
    value: np.ndarray


def to_host(obj):
    if isinstance(obj, torch.Tensor):
        return _Array(obj.detach().cpu().numpy())
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(item) for item in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: to_host(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        if "backend_cache" in changes:
            changes["backend_cache"] = {}  # derived per step by each rank's own backend
        return dataclasses.replace(obj, **changes)
    return obj


def to_device(obj, device: torch.device):
    if isinstance(obj, _Array):
        return torch.from_numpy(obj.value).to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(item, device) for item in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: to_device(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def encode(message: tuple) -> bytes:
    return pickle.dumps(to_host(message), protocol=pickle.HIGHEST_PROTOCOL)


# ---- ranks 1..N-1 ----
def follower_main(rank: int, spec: RankSpec, conn) -> None:
    """A spawned rank's whole life: build its shard, report, then serve rank 0's commands."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
    conn.send(("started", None))  # imports done: rank 0 may now wait in the group's rendezvous
    try:
        join_group(spec, rank)
        state = load_rank(spec, rank)
    except BaseException as exc:
        conn.send(("error", f"rank {rank} failed to start: {exc!r}"))
        raise
    conn.send(("loaded", None))
    try:
        allocate_cache(spec, state, rank)
        serve(spec, state, rank, conn)
    except EOFError:
        log.error("tensor-parallel rank %d: rank 0 is gone (its pipe closed); exiting", rank)
        sys.exit(1)
    except Exception as exc:
        log.error("tensor-parallel rank %d failed and exits: %r", rank, exc)
        sys.exit(1)
    dist.destroy_process_group()


def serve(spec: RankSpec, state: RankState, rank: int, conn) -> None:
    """Run rank 0's commands in the order sent: every collective rank 0 enters, this rank enters too."""
    device, model = spec.device(rank), state.model
    if device.type == "cpu":
        torch.set_flush_denormal(True)  # as rank 0 does around each step (EngineCore._launch)
    hidden = model.config.hidden_size
    with torch.inference_mode():
        while True:
            message = pickle.loads(conn.recv_bytes())
            kind = message[0]
            if kind == "forward":
                _, input_ids, positions, meta, invariant = to_device(message, device)
                with batch_invariant(invariant):
                    model(input_ids, positions, state.kv_caches, meta)
            elif kind == "logits":
                _, rows, invariant = message
                with batch_invariant(invariant):
                    model.compute_logits(torch.empty(rows, hidden, dtype=spec.dtype, device=device))
            elif kind == "calibrate_kv":
                from engine.quant.kv_scales import calibrate_kv_scales

                _, sequences, method = message
                calibrate_kv_scales(model, state.kv_caches, sequences, spec.config.block_size, method)
            elif kind == "stop":
                return
            else:
                raise RuntimeError(f"unknown command {kind!r}")
