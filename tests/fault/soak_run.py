"""A soak: a steady request rate for many minutes, with throughput, latency and RSS per minute.

Shared by bench/soak.py (20 minutes by default) and tests/fault/test_soak.py
(about 2). Latency is a request's time from being sent to its committed result
being read (read_committed), so it includes the transaction flush interval.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from tests.fault.fleet import Fleet, Site
from tests.fault.ledger import Ledger, Load, audit, chat_requests, follow
from tests.fault.scenarios import Outcome
from worker.client import TopicReader


def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


@dataclass
class SoakReport:
    outcome: Outcome
    minutes: list[dict] = field(default_factory=list)  # one row per minute
    rss: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # worker -> (s, kB) samples

    HEADERS = ("minute", "sent", "answered", "req/s", "tokens/s", "p50 ms", "p99 ms", "max ms", "RSS MB", "errors")

    def rows(self) -> list[tuple]:
        return [tuple(m[k] for k in ("minute", "sent", "answered", "req_s", "tok_s", "p50_ms", "p99_ms", "max_ms",
                                     "rss_mb", "errors")) for m in self.minutes]

    @property
    def rss_growth(self) -> float:
        """Growth of the summed worker RSS from the end of the first minute to the end of the run."""
        first = [m["rss_kb"] for m in self.minutes if m["rss_kb"]]
        return first[-1] / first[0] - 1 if len(first) > 1 else 0.0


def soak(site: Site, *, minutes: float = 2.0, rate: float = 4.0, workers: int = 2, seed: int = 0,
         max_tokens: tuple[int, int] = (16, 64), sample_s: float = 2.0, env: dict[str, str] | None = None,
         sections: dict | None = None) -> SoakReport:
    """`sections`: worker config overrides, as Fleet takes them (e.g. {"memory": {"kv_cache_bytes": "16MiB"}})."""
    fleet = Fleet(site, site.topics("soak"), sections=dict(sections or {}), env=dict(env or {}))
    try:
        for i in range(1, workers + 1):
            fleet.start(f"w{i}")
        fleet.wait_ready()
        fleet.wait_all_assigned()
        pids = {wid: p.proc.pid for wid, p in fleet.live().items()}
        requests = chat_requests("soak", int(minutes * 60 * rate), seed, max_tokens=max_tokens)
        samples: dict[str, list[tuple[float, int]]] = {wid: [] for wid in pids}

        async def drive() -> tuple[Ledger, float, float]:
            ledger = Ledger.of(r.id for r, _ in requests)
            async with TopicReader(site.bootstrap, fleet.topics.results, from_beginning=True) as reader:
                follower = asyncio.create_task(follow(reader, ledger))
                async with Load(site.bootstrap, fleet.topics.chat, requests, rate, ledger) as load:
                    t0 = time.monotonic()
                    sender = asyncio.create_task(load.run())
                    deadline = t0 + minutes * 60 + 120
                    while not ledger.complete and time.monotonic() < deadline:
                        for wid, pid in pids.items():
                            kb = rss_kb(pid)
                            if kb:
                                samples[wid].append((round(time.monotonic() - t0, 1), kb))
                        await asyncio.sleep(sample_s)
                    wall = time.monotonic() - t0
                    await sender
                await asyncio.sleep(3.0)
                follower.cancel()
                await asyncio.gather(follower, return_exceptions=True)
            return ledger, t0, wall

        ledger, t0, wall = asyncio.run(drive())
        rows = _per_minute(ledger, t0, samples)
        fleet.stop()
        verdict = asyncio.run(audit(site.bootstrap, fleet.topics.results, ledger.expected))
        crashed = fleet.crashed()
        # Under steady load the stall watchdog must never step in: a stall here is a bug (or a false alarm).
        stalls = fleet.log_events("partition stalled")
        outcome = Outcome(f"soak {minutes:g} min", f"{rate:g} req/s, {len(requests)} chat, {workers} workers",
                          "none (steady load)", len(verdict.lost), len(verdict.duplicated), len(crashed), wall,
                          errors=len(verdict.errors),
                          failures=[f"{stalls} partitions stalled and were set up again"] if stalls else [],
                          detail={"lost": verdict.lost[:20], "duplicated": verdict.duplicated, "crashed": crashed,
                                  "errors": dict(list(verdict.errors.items())[:20])})
        return SoakReport(outcome, rows, samples)
    finally:
        fleet.stop()
        site.drop(fleet.topics)


def _per_minute(ledger: Ledger, t0: float, samples: dict[str, list[tuple[float, int]]]) -> list[dict]:
    by_minute: dict[int, list[str]] = {}
    for rid, at in ledger.first_read_at.items():
        by_minute.setdefault(int((at - t0) // 60), []).append(rid)
    sent_by_minute: dict[int, int] = {}
    for at in ledger.sent_at.values():
        sent_by_minute[int((at - t0) // 60)] = sent_by_minute.get(int((at - t0) // 60), 0) + 1
    rows = []
    for minute in sorted(set(by_minute) | set(sent_by_minute)):
        ids = by_minute.get(minute, [])
        lat = np.array([ledger.first_read_at[r] - ledger.sent_at[r] for r in ids if r in ledger.sent_at]) * 1000
        tokens = sum(ledger.results[r][0].usage.completion_tokens for r in ids)
        span = max(1e-9, min(60.0, max((ledger.first_read_at[r] - t0) for r in ids) - minute * 60)) if ids else 60.0
        # The RSS of every worker at the last sample of this minute, summed.
        rss = sum(next((kb for s, kb in reversed(trace) if s < (minute + 1) * 60), 0) for trace in samples.values())
        rows.append({
            "minute": minute + 1, "sent": sent_by_minute.get(minute, 0), "answered": len(ids),
            "req_s": round(len(ids) / span, 2), "tok_s": round(tokens / span, 1),
            "p50_ms": round(float(np.percentile(lat, 50)), 1) if len(lat) else None,
            "p99_ms": round(float(np.percentile(lat, 99)), 1) if len(lat) else None,
            "max_ms": round(float(lat.max()), 1) if len(lat) else None,
            "rss_kb": rss, "rss_mb": round(rss / 1024, 1),
            "errors": sum(ledger.results[r][0].status != "ok" for r in ids),
        })
    return rows
