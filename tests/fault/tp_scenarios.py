"""The tensor-parallel fault: one rank process of a worker is SIGKILLed under load.

The worker must notice at once, stop on its own with exit code 4 and a log line that says why, and the
consumer group must redeliver its uncommitted work: nothing lost, nothing answered twice.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.fault.fleet import Fleet, Site
from tests.fault.ledger import Ledger, chat_requests
from tests.fault.scenarios import Outcome, _drive, _finish, _start_group, _until_in_flight

TP = {"parallel": {"tensor_parallel_size": 2, "collective_timeout_s": 30}}
# The worker's own shutdown after the engine fails: the drain ends at once (nothing in flight can finish),
# then the flush and the consumer's leave are bounded by their timeouts.
EXIT_WITHIN_S = 30.0


def rank_processes(pid: int) -> list[int]:
    """The spawned tensor-parallel ranks among a worker's children (not multiprocessing's resource tracker)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    ranks = []
    for child in children:
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline:
            ranks.append(child)
    return sorted(ranks)


def rank_kill(site: Site, *, requests: int = 150, seed: int = 0, rate: float = 10.0,
              max_tokens: tuple[int, int] = (16, 96), timeout_s: float = 600) -> Outcome:
    fleet = Fleet(site, site.topics("tp-rank", partitions=4))
    events: dict = {}
    try:
        _start_group(fleet, 2, w1=TP)
        load = chat_requests("tprank", requests, seed, max_tokens=max_tokens)

        async def inject(ledger: Ledger, _load) -> None:
            while ledger.answered < 0.25 * requests:
                await asyncio.sleep(0.1)
            worker = fleet.current("w1")
            await _until_in_flight(worker, limit_s=30)
            ranks = await asyncio.to_thread(rank_processes, worker.proc.pid)
            events["ranks"] = ranks
            if len(ranks) != 1:
                return
            fleet.expect_exit("w1")
            events["in_flight_at_kill"] = ((await asyncio.to_thread(worker.ready)) or {}).get("in_flight")
            t0 = time.monotonic()
            os.kill(ranks[0], signal.SIGKILL)
            try:
                events["exit_code"] = await asyncio.to_thread(worker.proc.wait, 120)
            except subprocess.TimeoutExpired:
                events["exit_code"] = None
            events["exit_after_s"] = round(time.monotonic() - t0, 1)
            events["answered_at_kill"] = ledger.answered
            fleet.start("w1", **TP)  # back in the group once up

        ledger, wall = asyncio.run(_drive(site, fleet, load, rate, inject, timeout_s))
        failures = []
        if len(events.get("ranks", [])) != 1:
            failures.append(f"w1 should run one spawned rank, found {events.get('ranks')}")
        if events.get("exit_code") != 4:
            failures.append(f"w1 exited with {events.get('exit_code')}, not 4 (engine failed)")
        if events.get("exit_after_s", EXIT_WITHIN_S + 1) > EXIT_WITHIN_S:
            failures.append(f"w1 took {events.get('exit_after_s')} s to exit after its rank died")
        if fleet.log_events("the engine failed") < 1:
            failures.append("no 'the engine failed' line in w1's log")
        return _finish("tensor-parallel rank SIGKILL", f"{requests} chat, 2 workers (w1: 2 ranks)",
                       "SIGKILL of w1's rank 1", fleet, ledger, wall, failures, events)
    finally:
        fleet.stop()
        site.drop(fleet.topics)
