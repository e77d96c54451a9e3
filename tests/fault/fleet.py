"""Worker processes of one consumer group, and the place they run: broker, Redis, model, topics.

Shared by the fault tests and `bench/chaos.py`. Every worker is a real
`infinilm worker` process (tests.integration.worker_harness), so a kill is a
real SIGKILL. The fleet remembers which signal it sent to which process, so a
process that exited on its own counts as crashed, and so does one that did not
exit cleanly after SIGTERM.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from devstack import StackConfig, delete_topics, ensure_topics
from tests.integration.worker_harness import Topics, WorkerProcess, write_config

# Small timeouts so a dead member leaves the group in seconds, not the production 10 s + 3 s.
FAULT_KAFKA = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000, "flush_interval_ms": 50}
# One torch thread each: several workers share a two-core machine.
FAULT_EXECUTION = {"num_threads": 1, "max_batch_size": 16, "batch_timeout": "20ms"}
# aiokafka's retry messages while a broker is away (worker_warnings leaves them out).
_CLIENT_NOISE = ("Unable connect", "Unable to update metadata", "Failed fetch", "Group Coordinator Request failed",
                 "Got error produce response", "Cannot send", "Could not send", "Heartbeat", "Error sending Heartbeat",
                 "Marking the coordinator dead")


@dataclass
class Site:
    """Where a scenario runs. `stack` names the broker the topics live on (shared or private)."""

    stack: StackConfig
    redis_url: str
    model: str
    workdir: Path

    @property
    def bootstrap(self) -> str:
        return self.stack.bootstrap_servers

    def topics(self, scenario: str, partitions: int = 3) -> Topics:
        """Fresh topics for one run; the request topics get `partitions`, so rebalances move work."""
        suffix = uuid.uuid4().hex[:8]
        names = {kind: f"fault.{scenario}.{kind}.{suffix}" for kind in ("chat", "asr", "risk", "results", "deltas", "dlq")}
        for kind, name in names.items():
            ensure_topics(self.stack, [name], 1 if kind in ("deltas", "dlq") else partitions)
        return Topics(**names)

    def drop(self, topics: Topics) -> None:
        with contextlib.suppress(Exception):
            delete_topics(self.stack, list(topics.as_dict().values()))

    @classmethod
    def on_local_stack(cls, prefix: str) -> Site:
        """For the bench scripts: the local stack (started if need be) and the tests' tiny llama in a temp folder."""
        from devstack import stack_up
        from tests.conftest import write_tiny_model

        stack = StackConfig()
        stack_up(stack)
        workdir = Path(tempfile.mkdtemp(prefix=prefix))
        return cls(stack, stack.redis_url, str(write_tiny_model(workdir / "tiny-llama", "llama")), workdir)


@dataclass
class _Run:
    worker_id: str
    process: WorkerProcess
    signalled: int | None = None
    # Whether /readyz answered when the signal went out. Before that the process has no
    # SIGTERM handler yet (it is loading the model) and no partitions, so dying of the
    # signal (exit -15) is a clean stop, not a crash.
    serving: bool = True


@dataclass
class Fleet:
    site: Site
    topics: Topics
    sections: dict = field(default_factory=dict)  # config overrides for every worker
    env: dict[str, str] = field(default_factory=dict)  # added to every worker's environment
    group: str = field(default_factory=lambda: f"fault-{uuid.uuid4().hex[:8]}")
    runs: list[_Run] = field(default_factory=list)

    def start(self, worker_id: str, **overrides) -> WorkerProcess:
        """Start a process for `worker_id`; a restart keeps the id (and appends to its log)."""
        sections = {"kafka": dict(FAULT_KAFKA), "execution": dict(FAULT_EXECUTION),
                    "redis": {"key_prefix": self.group}}
        for merged in (self.sections, overrides):
            for name, values in merged.items():
                sections.setdefault(name, {}).update(values)
        # A `redis: {url: ...}` override (a private Redis) wins over the site's.
        config = write_config(self.site.workdir / f"{self.group}.{worker_id}.yaml", model=self.site.model,
                              topics=self.topics, group=self.group, bootstrap=self.site.bootstrap,
                              redis_url=self.site.redis_url, **sections)
        process = WorkerProcess(config, worker_id, self.site.workdir / f"{self.group}.{worker_id}.log",
                                env=dict(self.env)).start()
        self.runs.append(_Run(worker_id, process))
        return process

    def current(self, worker_id: str) -> WorkerProcess:
        return next(r.process for r in reversed(self.runs) if r.worker_id == worker_id)

    def live(self) -> dict[str, WorkerProcess]:
        return {r.worker_id: r.process for r in self.runs if r.process.proc.poll() is None}

    def signal(self, worker_id: str, sig: int) -> WorkerProcess:
        run = next(r for r in reversed(self.runs) if r.worker_id == worker_id)
        self._send(run, sig)
        return run.process

    def expect_exit(self, worker_id: str) -> None:
        """The test is about to make `worker_id` exit on its own (e.g. by killing one of its children):
        its exit then counts as caused, like a signal the fleet sent, not as a crash."""
        run = next(r for r in reversed(self.runs) if r.worker_id == worker_id)
        run.serving = run.process.ready() is not None
        run.signalled = signal.SIGKILL

    def _send(self, run: _Run, sig: int) -> None:
        run.serving = run.process.ready() is not None
        run.signalled = sig
        run.process.signal(sig)

    def wait_ready(self, timeout: float = 180) -> None:
        for process in self.live().values():
            process.wait_ready(timeout, assigned=False)

    def wait_all_assigned(self, timeout: float = 90) -> None:
        """Until every live worker holds a partition, so the load starts spread over the group."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [p.ready() or {} for p in self.live().values()]
            if all(s.get("assigned_partitions", 0) > 0 for s in states):
                return
            time.sleep(0.3)
        raise TimeoutError(f"not every worker was assigned partitions in {timeout}s")

    def assigned(self) -> list[str]:
        """Live workers that hold partitions now."""
        return sorted(wid for wid, p in self.live().items() if (p.ready() or {}).get("assigned_partitions", 0) > 0)

    def crashed(self) -> list[str]:
        """Processes that exited without being told to, or that a SIGTERM did not stop cleanly."""
        bad = []
        for run in self.runs:
            code = run.process.proc.poll()
            if code is None:
                continue
            clean = code == 0 or (code == -signal.SIGTERM and not run.serving)
            if run.signalled is None or (run.signalled == signal.SIGTERM and not clean):
                bad.append(f"{run.worker_id} (pid {run.process.proc.pid}, exit {code})")
        return bad

    def log_events(self, event: str) -> int:
        """How many times any worker process of this fleet logged an event starting with `event`."""
        logs = {r.process.log_path: r.process for r in self.runs}
        return sum(str(e.get("event", "")).startswith(event) for p in logs.values() for e in p.log_events())

    def worker_warnings(self, limit: int = 15) -> dict[str, list[str]]:
        """The last `limit` warnings and errors each worker logged, for a failed run's report.
        aiokafka's own connection retries are left out: every broker outage logs hundreds."""
        out: dict[str, list[str]] = {}
        for path, process in {r.process.log_path: r.process for r in self.runs}.items():
            lines = []
            for e in process.log_events():
                event = str(e.get("event", ""))
                if e.get("level") not in ("warning", "error", "critical") or event.startswith(_CLIENT_NOISE):
                    continue
                extra = {k: v for k, v in e.items() if k not in ("event", "level", "timestamp", "worker_id")}
                lines.append(f"{str(e.get('timestamp', ''))[11:23]} {event[:160]} {extra}"[:400])
            out[path.stem.split(".")[-1]] = lines[-limit:]
        return out

    def shutdowns_that_handed_back_work(self, worker_id: str) -> int:
        """Shutdowns of `worker_id` that handed in-flight requests back for redelivery: aborted when the
        drain ran out, or dropped with partitions that a rebalance revoked (or another worker fenced)
        while it was stopping. Which of the two happens is a race with the group's rebalance."""
        process = next(r.process for r in self.runs if r.worker_id == worker_id)  # one log file per worker id
        handed_back, stopping = 0, False
        for e in process.log_events():
            event = str(e.get("event", ""))
            if event == "shutting down":
                stopping = True
            elif event == "worker stopped":
                stopping = False
            elif stopping and (event.startswith("aborting unfinished requests")
                               or int(e.get("dropped_in_flight") or 0) > 0):
                handed_back += 1
                stopping = False
        return handed_back

    def stop(self, timeout_s: float = 60) -> None:
        """SIGTERM every live worker once and wait; a non-zero exit then counts in crashed().

        Once only: after its event loop closes, a worker's SIGTERM handler is gone, so a
        second SIGTERM during interpreter teardown would kill it (exit -15) after a clean stop.
        """
        for run in self.runs:
            if run.process.proc.poll() is None and run.signalled != signal.SIGTERM:
                self._send(run, signal.SIGTERM)
        for run in self.runs:
            try:
                run.process.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                run.signalled = None  # a hang on shutdown is a crash
                run.process.proc.kill()
                run.process.proc.wait(10)
            run.process.stop()  # exited by now: this only closes its log

