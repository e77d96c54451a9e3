"""Latency the Kafka path adds to one request at a time, by producer retry backoff and flush policy.

Kafka 4 often answers a transaction's first write with a retriable NOT_ENOUGH_REPLICAS
while the same producer's previous transaction is still completing (KIP-890's check;
docs/operations.md). The producer retries after `kafka.producer_retry_backoff_ms`. And a
finished result waits for the next flush: the interval's tick, or with `kafka.eager_flush`
at once when the worker has not flushed for an interval. This script starts a worker through
`infinilm worker` once per setting and round, alternating between the settings. It then sends chat requests one at a time: each is produced, and
its committed result is read (read_committed) before the next is sent. For each request
it records the time from produce to result, minus the worker's own `timing.total_ms`,
which is the part Kafka and the transaction add. It also counts the retries the worker
logged.

    .venv/bin/python -m bench.kafka_latency              # 40 requests x 2 rounds x 3 settings
    .venv/bin/python -m bench.kafka_latency --quick      # 8 requests, 1 round, to check the script
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid

import numpy as np

from bench.report import (
    PERF,
    console,
    invocation,
    markdown_table,
    print_table,
    update_docs_section,
    write_json,
)

# name -> (kafka.producer_retry_backoff_ms, kafka.eager_flush); the first is how the worker ran before
# either setting existed, the last is its defaults.
SETTINGS = {
    "backoff 100 ms (aiokafka's default), flush on the tick": (100, False),
    "backoff 20 ms, flush on the tick": (20, False),
    "backoff 20 ms, eager flush (defaults)": (20, True),
}
RETRY_LOG = "NotEnoughReplicasError"


async def _sequential(bootstrap: str, topics, n: int, tag: str) -> list[float]:
    from schemas import ChatRequest, Message
    from worker.client import RequestProducer, TopicReader, collect_results

    added = []
    async with TopicReader(bootstrap, topics.results) as results, RequestProducer(bootstrap) as producer:
        for i in range(n):
            rid = f"lat-{tag}-{i}"
            req = ChatRequest(id=rid, messages=[Message(role="user", content=f"Say the number {i}.")],
                              max_tokens=4, temperature=0.0)
            t0 = time.perf_counter()
            await producer.send(topics.chat, req, "msgpack")
            await producer.flush()
            got = await collect_results(results, [rid], timeout_s=120)
            if rid not in got:
                raise RuntimeError(f"no committed result for {rid} within 120 s; see the worker log")
            elapsed_ms = (time.perf_counter() - t0) * 1000
            added.append(elapsed_ms - got[rid][0].timing.total_ms)
    return added


def run_setting(model: str, backoff_ms: int, eager: bool, n: int) -> dict:
    from bench.kafka_worker import worker_on_fresh_topics

    with worker_on_fresh_topics(
            model, "latency",
            # The worker's defaults for batching and flushing (the test harness shortens them).
            execution={"batch_timeout": "50ms", "max_batch_size": 16},
            kafka={"producer_retry_backoff_ms": backoff_ms, "eager_flush": eager, "flush_interval_ms": 100},
    ) as (worker, topics, bootstrap):
        added = asyncio.run(_sequential(bootstrap, topics, n, uuid.uuid4().hex[:8]))
    return {"backoff_ms": backoff_ms, "eager_flush": eager, "added_ms": added,
            "retries_logged": worker.logs().count(RETRY_LOG)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 requests, one round, to check the script")
    ap.add_argument("--requests", type=int, default=40, help="requests per worker run, sent one at a time")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per setting; all runs are pooled")
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    command = invocation("bench.kafka_latency")
    console.print(f"[bold]$ {command}[/]")

    from engine.model_registry import resolve_model

    model = str(resolve_model(args.model))
    n, rounds = (8, 1) if args.quick else (args.requests, args.rounds)
    load_at_start = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for r in range(rounds):
        for name, (backoff, eager) in SETTINGS.items():
            with console.status(f"{name}: {n} requests one at a time (round {r + 1}/{rounds})..."):
                runs[name].append(run_setting(model, backoff, eager, n))

    headers = ["worker settings", "requests", "retries logged", "p50 ms", "p90 ms", "p99 ms", "max ms",
               "mean ms"]
    rows, summary = [], {}
    for name, setting_runs in runs.items():
        added = np.array([x for run in setting_runs for x in run["added_ms"]])
        retries = sum(run["retries_logged"] for run in setting_runs)
        stats = {q: float(np.percentile(added, q)) for q in (50, 90, 99)}
        summary[name] = {"requests": int(added.size), "retries_logged": retries, **{f"p{q}": v for q, v in
                                                                                  stats.items()},
                         "max": float(added.max()), "mean": float(added.mean())}
        rows.append((name, added.size, retries, *(f"{stats[q]:.0f}" for q in (50, 90, 99)), f"{added.max():.0f}",
                     f"{added.mean():.0f}"))
    title = "latency Kafka and the transaction add to one request at a time (result read minus worker's total_ms)"
    print_table(title, headers, rows)
    means = [summary[name]["mean"] for name in SETTINGS]
    ratios = "; ".join(f"{name}: {m / means[0]:.2f}" for name, m in list(zip(SETTINGS, means, strict=True))[1:])
    console.print(f"mean added latency ÷ the first row's: {ratios}")

    data = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "requests": n,
            "rounds": rounds, "load_average_at_start": load_at_start, "summary": summary,
            "runs": {name: setting_runs for name, setting_runs in runs.items()}}
    write_json("kafka_latency-quick.json" if args.quick else "kafka_latency.json", data)
    if not args.quick:
        update_docs_section("kafka_latency", "\n\n".join([
            "## Latency of one request at a time through Kafka, by producer retry backoff and flush policy",
            f"Measured {data['date']} on this repository's 2-core dev machine (load average at start "
            f"{load_at_start:.1f}). Reproduce with:",
            f"    {command}",
            markdown_table(title, headers, rows),
            f"Mean added latency ÷ the first row's (how the worker ran before both settings): {ratios}. Each "
            f"setting ran {rounds} times, alternating with the others, {n} requests per run, pooled. Every run is a fresh worker process "
            "started through `infinilm worker` on fresh topics. A request is produced only after the previous "
            "one's committed result has been read. Each request's added latency is the time from produce to "
            "reading its committed result, minus the worker's own `timing.total_ms` (queueing, prefill and "
            "decode). The flush interval is the default 100 ms. \"retries logged\" counts the worker's `NotEnoughReplicasError` retries. On Kafka 4 these "
            "come from KIP-890's check while the previous transaction completes, and each one waits out the "
            "backoff before it retries. An eager flush commits a result as soon as it is finished when the "
            "worker has not flushed results for an interval, as here, where requests come one at a time. Under "
            "load, flushes of finished results still start at most once per interval, as on the tick.",
        ]), docs=PERF / "service.md")


if __name__ == "__main__":
    main()
