"""A fuzz run: thousands of bad records into the request topics of one real worker, every one accounted for.

Each message must come back exactly once: as a result with its id (when it
carries a usable one) or as a dead letter pointing at its topic, partition and
offset. The worker must stay up, and its resident memory must stay flat after
a warm-up share of the messages. Shared by tests/fault/test_fuzz.py and
bench/chaos.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka import AIOKafkaProducer

from schemas import ChatRequest, Message, SchemaError, decode_dead_letter, decode_result
from tests.fault.fleet import Fleet, Site
from tests.fault.fuzz_messages import Draft, draw_many, quotas, realize
from tests.fault.ledger import read_committed
from tests.fault.scenarios import Outcome
from worker.client import RequestProducer, TopicReader

# The bound: the worker's RSS stays within 5% of its size after the warm-up.
RSS_LIMIT = 0.05
# The worker runs as shipped (its KV pool is resident from allocation: torch.zeros writes every
# page). Its memory still grows while it first meets each engine shape: oneDNN keeps a compiled primitive per
# (row bucket, weight) for the process's life (engine/models/linear.py). So the warm-up starts
# with a sweep of valid prompts of every length up to the tiny model's 512 positions (the chat
# template adds about 30 tokens), before the fuzz warm-up share; after that RSS must be flat.
SWEEP_MAX_CHARS = 480
# RSS is read when the worker is quiet: this long after the answers of the warm-up and of each round, so that
# its housekeeping tick (every 5 s: a full collection, then malloc_trim; worker/memory.py) has handed freed
# memory back. A burst of megabyte records (fetch responses, oversized records, their dead letters) raises RSS
# while it is served and that memory is freed after it; the readings compare what stays, which is where a leak
# shows, round after round. The highest sample of the whole run is reported too (`rss_peak_kb`).
QUIET_S = 6.0


@dataclass
class Sent:
    category: str
    rid: str | None  # the id an error result must carry; None when only a dead letter can answer
    where: tuple[str, int, int]  # topic, partition, offset


@dataclass
class RssTrace:
    pid: int
    samples: list[tuple[float, int]] = field(default_factory=list)  # (seconds, kB)

    def read(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError(f"no VmRSS for pid {self.pid}")

    async def follow(self, every_s: float = 0.5) -> None:
        t0 = time.monotonic()
        while True:
            with contextlib.suppress(OSError):
                self.samples.append((round(time.monotonic() - t0, 1), self.read()))
            await asyncio.sleep(every_s)


def make_drafts(total: int, seed: int, max_bytes: int, max_seq_len: int) -> list[Draft]:
    drafts = []
    for k, (strategy, n) in enumerate(quotas(total, max_bytes, max_seq_len)):
        drafts += draw_many(strategy, n, seed * 100 + k)
    # Interleaved, so the warm-up share sees every kind of bad input.
    random.Random(seed).shuffle(drafts)
    return drafts


class _Outputs:
    """Results and dead letters of the run as they arrive (the live count; the verdict re-reads)."""

    def __init__(self) -> None:
        self.count = 0

    async def follow(self, readers: list[TopicReader]) -> None:
        while True:
            for reader in readers:
                self.count += len(await reader.poll(100))


async def _produce(bootstrap: str, topics, run: str, drafts: list[Draft], offset: int) -> list[Sent]:
    # Up to the broker's record limit (the local stack's message.max.bytes is 2 MiB), so the
    # oversized records get through to the worker.
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=10,
                                max_request_size=3 << 20)
    await producer.start()
    try:
        pending = []
        for i, draft in enumerate(drafts, start=offset):
            rid = f"{run}-{i}"
            value, uses_id = realize(draft, rid)
            headers = [("content-type", draft.content_type)] if draft.content_type is not None else []
            future = await producer.send(getattr(topics, draft.topic), value, key=draft.key, headers=headers)
            pending.append((draft, rid if uses_id else None, future))
        sent = []
        for draft, rid, future in pending:
            meta = await future
            sent.append(Sent(draft.category, rid, (meta.topic, meta.partition, meta.offset)))
        return sent
    finally:
        await producer.stop()


async def _until(outputs: _Outputs, want: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while outputs.count < want and time.monotonic() < deadline:
        await asyncio.sleep(0.2)


def fuzz(site: Site, *, total: int = 10_000, seed: int = 0, warmup_share: float = 0.2, rounds: int = 4,
         max_message_bytes: int = 1 << 20, timeout_s: float = 600) -> Outcome:
    fleet = Fleet(site, site.topics("fuzz"), sections={"kafka": {"max_message_bytes": max_message_bytes}})
    run = f"fz{seed}"
    try:
        worker = fleet.start("w1")
        started = time.monotonic()  # generate while the worker loads its model
        drafts = make_drafts(total, seed, max_message_bytes, max_seq_len=512)
        generated_s = time.monotonic() - started
        worker.wait_ready()
        rss = RssTrace(worker.proc.pid)
        warm = int(total * warmup_share)
        sweep_ids = [f"{run}-sweep-{n}" for n in range(0, SWEEP_MAX_CHARS, 2)]

        async def drive() -> tuple[list[Sent], dict]:
            outputs = _Outputs()
            async with (TopicReader(site.bootstrap, fleet.topics.results, from_beginning=True) as results,
                        TopicReader(site.bootstrap, fleet.topics.dlq, from_beginning=True) as dlq):
                tasks = [asyncio.create_task(outputs.follow([results, dlq])), asyncio.create_task(rss.follow())]
                try:
                    t0 = time.monotonic()
                    await _sweep(site.bootstrap, fleet.topics.chat, sweep_ids)
                    sent = await _produce(site.bootstrap, fleet.topics, run, drafts[:warm], 0)
                    await _until(outputs, len(sent) + len(sweep_ids), timeout_s)
                    await asyncio.sleep(QUIET_S)
                    marks = {"warmup_s": round(time.monotonic() - t0, 1), "baseline_kb": rss.read(),
                             "baseline_at": len(rss.samples)}
                    # The rest in equal rounds, RSS read when quiet after each: a leak grows round after round,
                    # a high-water mark does not.
                    marks["rss_after_round_kb"] = []
                    step = max(1, -(-(total - warm) // rounds))
                    for start in range(warm, total, step):
                        sent += await _produce(site.bootstrap, fleet.topics, run, drafts[start:start + step], start)
                        await _until(outputs, len(sent) + len(sweep_ids), timeout_s)
                        await asyncio.sleep(QUIET_S)  # also the window in which a duplicate would show up
                        marks["rss_after_round_kb"].append(rss.read())
                    marks["answered_s"] = round(time.monotonic() - t0, 1)
                    marks["final_kb"] = rss.read()
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
            return sent, marks

        sent, marks = asyncio.run(drive())
        dlq_metric = _dlq_metric(worker)
        fleet.stop()
        verdict = asyncio.run(_count(site.bootstrap, fleet.topics, run, sent, sweep_ids))
        quiet = [*marks["rss_after_round_kb"], marks["final_kb"]]
        growth = max(quiet) / marks["baseline_kb"] - 1
        peak = max([kb for _, kb in rss.samples[marks["baseline_at"]:]] + quiet)
        crashed = fleet.crashed()
        failures = list(verdict.pop("failures"))
        # Kept apart from `failures`, so the exactly-one-answer verdict and this one are asserted
        # (and reported) separately; bench/chaos.py shows both.
        rss_problem = None
        if growth > RSS_LIMIT:
            rss_problem = (f"RSS grew {growth:.1%} after warm-up ({marks['baseline_kb']} kB when quiet -> "
                           f"{max(quiet)} kB when quiet after a round)")
        if dlq_metric is not None and dlq_metric != verdict["dead_letters"]:
            failures.append(f"infinilm_dlq_records_total says {dlq_metric}, the DLQ topic holds {verdict['dead_letters']}")
        detail = {**verdict, **marks, "rss_growth": round(growth, 4), "rss_peak_kb": peak,
                  "rss_samples": rss.samples[:: max(1, len(rss.samples) // 60)], "generate_s": round(generated_s, 1),
                  "crashed": crashed, "seed": seed, "rss_problem": rss_problem}
        return Outcome("bad-input fuzz", f"{total:,} records, 7 kinds of bad input", "bad input (hypothesis)",
                       verdict["lost"], verdict["repeated"], len(crashed), marks["answered_s"],
                       failures=failures, detail=detail)
    finally:
        fleet.stop()
        site.drop(fleet.topics)


def _dlq_metric(worker) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = worker.metrics()
    except OSError:
        return None
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "infinilm_dlq_records_total")


async def _sweep(bootstrap: str, topic: str, ids: list[str]) -> None:
    """Valid chat requests of every prompt length in steps of two, for the warm-up (see SWEEP_MAX_CHARS)."""
    async with RequestProducer(bootstrap, enable_idempotence=True) as producer:
        for rid in ids:
            n = int(rid.rsplit("-", 1)[1])
            request = ChatRequest(id=rid, messages=[Message(role="user", content="a" * n)], max_tokens=2,
                                  temperature=0.0)
            await producer.send(topic, request, "msgpack")
        await producer.flush()


async def _count(bootstrap: str, topics, run: str, sent: list[Sent], sweep_ids: list[str]) -> dict:
    """Match every committed output to the message it answers; each message needs exactly one."""
    by_id = {s.rid: i for i, s in enumerate(sent) if s.rid}
    sweep: Counter[str] = Counter()
    sweep_failed: list[str] = []
    wanted_sweep = set(sweep_ids)
    by_where = {s.where: i for i, s in enumerate(sent)}
    answers: Counter[int] = Counter()
    codes: dict[str, Counter[str]] = {"result": Counter(), "dead letter": Counter()}
    failures: list[str] = []
    stray = 0
    unexpected_ok: list[str] = []
    for rec in await read_committed(bootstrap, topics.results):
        result = decode_result(rec.value)
        if result.id in wanted_sweep:
            sweep[result.id] += 1
            if result.status != "ok":
                sweep_failed.append(f"{result.id}: {result.error.code if result.error else '?'}")
            continue
        i = by_id.get(result.id)
        if i is None:
            stray += 1
            continue
        answers[i] += 1
        code = "ok" if result.status == "ok" else (result.error.code if result.error else "")
        codes["result"][code or "(no code)"] += 1
        if result.status == "ok" and sent[i].category != "valid":
            unexpected_ok.append(f"{sent[i].category}: {result.id}")
    letters = 0
    for rec in await read_committed(bootstrap, topics.dlq):
        letters += 1
        try:
            letter = decode_dead_letter(rec.value)
        except SchemaError:
            stray += 1
            continue
        i = by_where.get((letter.topic, letter.partition, letter.offset))
        if i is None:
            stray += 1
            continue
        answers[i] += 1
        codes["dead letter"][letter.reason.code or "(no code)"] += 1
    missing = [f"{s.category}@{s.where}" for i, s in enumerate(sent) if answers[i] == 0]
    repeated = [f"{sent[i].category}@{sent[i].where} x{n}" for i, n in answers.items() if n > 1]
    if stray:
        failures.append(f"{stray} outputs that answer no message of this run")
    if set(sweep) != wanted_sweep or any(n != 1 for n in sweep.values()) or sweep_failed:
        failures.append(f"warm-up sweep: {len(wanted_sweep - set(sweep))} unanswered, "
                        f"{sum(n > 1 for n in sweep.values())} answered twice, failed {sweep_failed[:5]}")
    if unexpected_ok:
        failures.append(f"bad input answered ok: {unexpected_ok[:5]}")
    for kind, counter in codes.items():
        if counter.get("(no code)"):
            failures.append(f"{counter['(no code)']} {kind}s without a reason code")
    return {"messages": len(sent), "by_category": dict(Counter(s.category for s in sent)),
            "codes": {k: dict(c.most_common()) for k, c in codes.items()}, "dead_letters": letters,
            "lost": len(missing), "repeated": len(repeated), "missing_sample": missing[:20],
            "repeated_sample": repeated[:20], "failures": failures}
