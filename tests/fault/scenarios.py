"""The fault scenarios: real processes killed, real servers stopped, then every result counted.

Each scenario starts its own workers on fresh topics, drives a steady load,
injects its fault from a coroutine beside the load, waits for every request's
first committed result, stops the workers, and only then audits the results
topic from the beginning (tests.fault.ledger.audit). It returns an `Outcome`:
the row of the reliability table, plus `failures`, the scenario's own checks
(a fault that never happened, a state that never showed) that the tests assert
on. The same functions run in the test suite and, with bigger loads, in
`bench/chaos.py`.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from tests.fault.fleet import Fleet, Site
from tests.fault.ledger import Audit, Ledger, Load, audit, chat_requests, follow, where_requests_are
from tests.fault.private_kafka import PrivateKafka
from tests.integration.redis_server import PrivateRedis
from tests.integration.worker_harness import WorkerProcess
from worker.client import TopicReader

Inject = Callable[[Ledger, Load], Awaitable[None]]


@dataclass
class Outcome:
    test: str
    load: str
    faults: str
    lost: int
    duplicated: int
    crashed: int
    wall_s: float
    errors: int = 0  # expected requests answered with an error result
    failures: list[str] = field(default_factory=list)
    detail: dict = field(default_factory=dict)

    HEADERS = ("test", "load", "faults injected", "lost", "duplicated", "crashed", "wall s")

    def row(self) -> tuple:
        return (self.test, self.load, self.faults, self.lost, self.duplicated, self.crashed, f"{self.wall_s:.0f}")

    def problems(self) -> list[str]:
        """Everything that should fail a test: loss, duplicates, crashes, errors and failed checks."""
        out = list(self.failures)
        for name in ("lost", "duplicated", "crashed", "errors"):
            if getattr(self, name):
                out.append(f"{name}: {getattr(self, name)} ({self.detail.get(name)})")
        return out


def metric(process: WorkerProcess, name: str) -> float | None:
    """One unlabelled sample from a worker's /metrics, or None when it does not answer."""
    try:
        text = process.metrics()
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and not sample.labels:
                return sample.value
    return None


async def _drive(site: Site, fleet: Fleet, requests, rate: float, inject: Inject, timeout_s: float,
                 linger_s: float = 1.0) -> tuple[Ledger, float]:
    """Run the load and the injector; return the ledger and the seconds until every id was answered."""
    ledger = Ledger.of(r.id for r, _ in requests)
    async with TopicReader(site.bootstrap, fleet.topics.results, from_beginning=True) as reader:
        follower = asyncio.create_task(follow(reader, ledger))
        async with Load(site.bootstrap, fleet.topics.chat, requests, rate, ledger) as load:
            start = time.monotonic()
            sender = asyncio.create_task(load.run())
            injector = asyncio.create_task(inject(ledger, load))
            deadline = start + timeout_s
            while time.monotonic() < deadline and not (ledger.complete and injector.done()):
                await asyncio.sleep(0.2)
                for task in (sender, injector):
                    if task.done() and task.exception():
                        raise task.exception()
            wall = time.monotonic() - start
            injector.cancel()
            sender.cancel()
            await asyncio.gather(injector, sender, return_exceptions=True)
        # Read on a little: a duplicate committed just after the last first copy would show here,
        # though the audit below is what decides.
        await asyncio.sleep(linger_s)
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
    return ledger, wall


def _finish(test: str, load: str, faults: str, fleet: Fleet, ledger: Ledger, wall: float,
            failures: list[str], detail: dict) -> Outcome:
    """Stop the workers, then audit: nothing may change the results topic while it is read."""
    fleet.stop()
    crashed = fleet.crashed()
    verdict: Audit = asyncio.run(audit(fleet.site.bootstrap, fleet.topics.results, ledger.expected))
    if verdict.unexpected:
        failures.append(f"{verdict.unexpected} committed results with ids nobody sent")
    detail.update(lost=verdict.lost[:20], duplicated=dict(list(verdict.duplicated.items())[:20]),
                  crashed=crashed, errors=dict(list(verdict.errors.items())[:20]), committed_records=verdict.records,
                  answered_live=ledger.answered)
    if ledger.undelivered:
        failures.append(f"{len(ledger.undelivered)} requests never reached the broker (the test's producer "
                        f"failed, not a worker): {dict(list(ledger.undelivered.items())[:5])}")
    if verdict.lost:
        # What a failed run's report needs to tell a lost request from a stuck partition or a client fault.
        detail["lost_requests_at"] = asyncio.run(where_requests_are(fleet.site.bootstrap, fleet.topics.chat,
                                                                    verdict.lost))
    # The stall watchdog may rescue a run (worker.partitions.check_progress); the report says when it did.
    detail["partition_stalls"] = fleet.log_events("partition stalled")
    if verdict.lost or verdict.duplicated or crashed or failures or detail["partition_stalls"]:
        detail["worker_warnings"] = fleet.worker_warnings()
    return Outcome(test, load, faults, len(verdict.lost), len(verdict.duplicated), len(crashed), wall,
                   errors=len(verdict.errors), failures=failures, detail=detail)


def _start_group(fleet: Fleet, workers: int, **per_worker) -> None:
    for i in range(1, workers + 1):
        fleet.start(f"w{i}", **per_worker.get(f"w{i}", {}))
    fleet.wait_ready()
    fleet.wait_all_assigned()


async def _victim(fleet: Fleet, rng: random.Random, exclude: tuple[str, ...] = ()) -> str:
    """A seeded choice among the workers that hold partitions now, so the kill costs them work."""
    while True:
        candidates = [w for w in await asyncio.to_thread(fleet.assigned) if w not in exclude]
        if candidates:
            return rng.choice(candidates)
        await asyncio.sleep(0.5)


async def _until_in_flight(process: WorkerProcess, limit_s: float, at_least: int = 1) -> None:
    """Until the worker's /readyz shows `at_least` requests in flight (or `limit_s` passed; the caller's check then fails)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if ((await asyncio.to_thread(process.ready)) or {}).get("in_flight", 0) >= at_least:
            return
        await asyncio.sleep(0.05)


# ---- worker kills ---------------------------------------------------------------


def worker_kills(site: Site, *, requests: int = 500, workers: int = 3, kills: int = 3, seed: int = 0,
                 rate: float = 8.0, max_tokens: tuple[int, int] = (16, 160), timeout_s: float = 600) -> Outcome:
    """SIGKILL a worker at `kills` seeded moments and restart it each time."""
    rng = random.Random(seed)
    fleet = Fleet(site, site.topics("kills", partitions=6))
    done: list[dict] = []
    try:
        _start_group(fleet, workers)
        load = chat_requests("kill", requests, seed, max_tokens=max_tokens)
        duration = requests / rate
        moments = sorted(rng.uniform(0.1, 0.8) * duration for _ in range(kills))

        async def inject(ledger: Ledger, _load: Load) -> None:
            t0 = time.monotonic()
            for at in moments:
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                victim = await _victim(fleet, rng)
                fleet.signal(victim, signal.SIGKILL)
                done.append({"at_s": round(time.monotonic() - t0, 1), "worker": victim, "answered": ledger.answered})
                fleet.start(victim)  # it rejoins the group when it is up

        ledger, wall = asyncio.run(_drive(site, fleet, load, rate, inject, timeout_s))
        failures = [] if len(done) == kills else [f"only {len(done)} of {kills} kills happened"]
        return _finish("worker SIGKILL + restart", f"{requests} chat (json+msgpack), {workers} workers",
                       f"{len(done)} × SIGKILL", fleet, ledger, wall, failures, {"kills": done, "seed": seed})
    finally:
        fleet.stop()
        site.drop(fleet.topics)


# ---- broker restart ----------------------------------------------------------------


def broker_restart(site: Site, *, requests: int = 300, workers: int = 2, down_s: float = 10.0, hard: bool = False,
                   seed: int = 0, rate: float = 6.0, max_tokens: tuple[int, int] = (16, 160),
                   timeout_s: float = 600) -> Outcome:
    """Stop this run's own broker mid-run (SIGTERM, or SIGKILL with `hard`) and start it again."""
    broker = PrivateKafka(site.workdir / f"kafka-{seed}", site.stack)
    broker.start()
    private = Site(broker.config, site.redis_url, site.model, site.workdir)
    fleet = Fleet(private, private.topics("broker"))
    events: dict = {}
    try:
        _start_group(fleet, workers)
        pids = {wid: p.proc.pid for wid, p in fleet.live().items()}
        load = chat_requests("broker", requests, seed, max_tokens=max_tokens)

        async def inject(ledger: Ledger, lo: Load) -> None:
            while ledger.answered < 0.3 * requests:
                await asyncio.sleep(0.2)
            await lo.hold()  # no request is in doubt while the broker is away
            t0 = time.monotonic()
            events["answered_before"] = ledger.answered
            await asyncio.to_thread(broker.stop, hard=hard)
            events["stop_s"] = round(time.monotonic() - t0, 1)
            await asyncio.sleep(down_s)
            await asyncio.to_thread(broker.start)
            events["back_after_s"] = round(time.monotonic() - t0, 1)
            lo.release()
            back = time.monotonic()
            while ledger.answered_since(back) == 0:
                await asyncio.sleep(0.2)
            events["first_result_after_restart_s"] = round(time.monotonic() - back, 1)

        ledger, wall = asyncio.run(_drive(private, fleet, load, rate, inject, timeout_s))
        failures = []
        survivors = {wid: p.proc.pid for wid, p in fleet.live().items()}
        if survivors != pids:
            failures.append(f"workers did not survive the broker restart: before {pids}, after {survivors}")
        if "back_after_s" not in events:
            failures.append("the broker was never restarted")
        how = "SIGKILL" if hard else "stop"
        return _finish(f"Kafka broker {how} + restart", f"{requests} chat, {workers} workers, private broker",
                       f"1 × broker {how}, down {down_s:.0f} s", fleet, ledger, wall, failures,
                       {"events": events, "worker_pids": pids})
    finally:
        fleet.stop()
        broker.close()


# ---- Redis outage -------------------------------------------------------------------


def redis_outage(site: Site, *, requests: int = 300, workers: int = 2, down_s: float = 15.0, hang: bool = False,
                 seed: int = 0, rate: float = 6.0, max_tokens: tuple[int, int] = (16, 160),
                 timeout_s: float = 600) -> Outcome:
    """Stop (or, with `hang`, SIGSTOP) a private Redis mid-run, then bring it back."""
    redis = PrivateRedis(site.workdir / f"redis-{seed}-{int(hang)}")
    redis.start()
    fleet = Fleet(site, site.topics("redis"), sections={"redis": {"url": redis.url, "heartbeat_interval_s": 1}})
    events: dict = {}
    failures: list[str] = []

    def states(want: str, up: float) -> bool:
        live = list(fleet.live().values())
        return bool(live) and all((p.ready() or {}).get("redis") == want and metric(p, "infinilm_redis_up") == up
                                  for p in live)

    async def until(check, limit_s: float) -> float | None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit_s:
            if await asyncio.to_thread(check):
                return round(time.monotonic() - t0, 1)
            await asyncio.sleep(0.5)
        return None

    try:
        _start_group(fleet, workers)
        load = chat_requests("redis", requests, seed, max_tokens=max_tokens)

        async def inject(ledger: Ledger, _load: Load) -> None:
            if await until(lambda: states("ok", 1.0), 30) is None:
                failures.append("redis was never 'ok' before the outage")
            while ledger.answered < 0.25 * requests:
                await asyncio.sleep(0.2)
            t0 = time.monotonic()
            await asyncio.to_thread(redis.pause if hang else redis.stop)
            events["degraded_after_s"] = await until(lambda: states("degraded", 0.0), down_s + 20)
            await asyncio.sleep(max(0.0, down_s - (time.monotonic() - t0)))
            events["answered_while_down"] = ledger.answered_since(t0)
            await asyncio.to_thread(redis.resume if hang else redis.start)
            events["recovered_after_s"] = await until(lambda: states("ok", 1.0), 60)
            if events["degraded_after_s"] is None:
                failures.append("/readyz and infinilm_redis_up never showed the outage")
            if not events["answered_while_down"]:
                failures.append("no result was committed while Redis was down")
            if events["recovered_after_s"] is None:
                failures.append("the workers did not see Redis come back")

        ledger, wall = asyncio.run(_drive(site, fleet, load, rate, inject, timeout_s))
        how = "SIGSTOP (hang)" if hang else "stop"
        return _finish(f"Redis {how} + restart", f"{requests} chat, {workers} workers, private Redis",
                       f"1 × Redis {how}, {down_s:.0f} s", fleet, ledger, wall, failures, {"events": events})
    finally:
        fleet.stop()
        redis.stop()
        site.drop(fleet.topics)


# ---- long generations ---------------------------------------------------------------------


def long_generations(site: Site, *, model: str, concurrent: int = 4, max_tokens: int = 200, workers: int = 2,
                     max_poll_interval_ms: int = 6000, timeout_s: float = 600) -> Outcome:
    """Generations that outlast max_poll_interval_ms: no rebalance, no duplicate. The workers' engines keep no
    packed weight copies (their slower decode path), so that the generations last long enough to prove it."""
    slow = Site(site.stack, site.redis_url, model, site.workdir)
    fleet = Fleet(slow, slow.topics("long"), sections={"kafka": {"max_poll_interval_ms": max_poll_interval_ms},
                                                       "memory": {"cpu_prepack_weights": False}})
    try:
        _start_group(fleet, workers)
        time.sleep(3)  # let the joins settle, so the counts below start from a stable group
        before = {e: fleet.log_events(e) for e in ("partitions assigned", "partitions revoked")}
        load = chat_requests("long", concurrent, 0, max_tokens=(max_tokens, max_tokens))

        async def inject(_ledger: Ledger, _load: Load) -> None:
            return None

        ledger, wall = asyncio.run(_drive(slow, fleet, load, 100.0, inject, timeout_s, linger_s=4.0))
        after = {e: fleet.log_events(e) for e in before}
        totals = sorted(r[0].timing.total_ms for r in ledger.results.values() if r)
        failures = []
        if after != before:
            failures.append(f"rebalanced during the load: {before} -> {after}")
        if not totals or totals[-1] < max_poll_interval_ms:
            failures.append(f"no generation outlasted max_poll_interval_ms ({totals}); the run proves nothing")
        outcome = _finish("generation > max_poll_interval", f"{concurrent} × {max_tokens} tokens, {workers} workers",
                          f"max_poll_interval {max_poll_interval_ms / 1000:.0f} s", fleet, ledger, wall, failures,
                          {"total_ms": totals, "rebalance_events": after})
        return outcome
    finally:
        fleet.stop()
        site.drop(fleet.topics)


# ---- SIGTERM under load -------------------------------------------------------------------


HASTY_DRAIN_S = 0.001


def sigterm_under_load(site: Site, *, requests: int = 400, workers: int = 3, seed: int = 0, rate: float = 8.0,
                       max_tokens: tuple[int, int] = (32, 200), timeout_s: float = 600) -> Outcome:
    """SIGTERM two workers mid-load and restart them: one drains its work, one (1 ms to drain) hands it back."""
    rng = random.Random(seed)
    fleet = Fleet(site, site.topics("sigterm", partitions=6))
    done: list[dict] = []
    try:
        # The last worker barely waits before aborting, so its in-flight requests must be redelivered.
        hasty = f"w{workers}"
        # 1 ms: with 50 ms the tiny model sometimes finished the request in flight, and nothing was handed back.
        # It also runs one sequence at a time: the abort comes after the consumer is cancelled (tens of ms),
        # and two requests running side by side could both finish in that time (seen); with one at a time,
        # the second of the two it waits for has not started, so it cannot.
        hasty_config = {"worker": {"shutdown_timeout_s": HASTY_DRAIN_S},
                        "execution": {"max_num_seqs": 1, "max_batch_size": 1}}
        _start_group(fleet, workers, **{hasty: hasty_config})
        load = chat_requests("term", requests, seed, max_tokens=max_tokens)
        duration = requests / rate
        moments = sorted(rng.uniform(0.2, 0.7) * duration for _ in range(2))

        async def inject(ledger: Ledger, _load: Load) -> None:
            t0 = time.monotonic()
            for i, at in enumerate(moments):
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                victim = await _victim(fleet, rng, exclude=(hasty,)) if i == 0 else hasty
                if victim == hasty:
                    # Its SIGTERM must find work in flight, or the abort-and-redeliver path goes untested.
                    # Two or more, so one finishing in the moment the signal takes to act still leaves work.
                    await _until_in_flight(fleet.current(hasty), limit_s=duration, at_least=2)
                fleet.signal(victim, signal.SIGTERM)
                done.append({"at_s": round(time.monotonic() - t0, 1), "worker": victim, "answered": ledger.answered})
                # The replacement joins while the old process drains: the handover under test.
                overrides = hasty_config if victim == hasty else {}
                fleet.start(victim, **overrides)

        ledger, wall = asyncio.run(_drive(site, fleet, load, rate, inject, timeout_s))
        failures = [] if len(done) == 2 else [f"only {len(done)} of 2 SIGTERMs happened"]
        aborted = fleet.shutdowns_that_handed_back_work(hasty)
        return _finish("SIGTERM under load + restart", f"{requests} chat, {workers} workers",
                       f"2 × SIGTERM (drain 20 s / {HASTY_DRAIN_S * 1000:.0f} ms)", fleet, ledger, wall, failures,
                       {"terms": done, "shutdowns_that_aborted_work": aborted, "seed": seed})
    finally:
        fleet.stop()
        site.drop(fleet.topics)
