"""ASR post-correction latency per chunk through Kafka, with prompt-lookup speculation off and on.

One `infinilm worker` process per arm and round (alternating, so a load change on the host hits both arms
alike), on fresh topics, both with synchronous scheduling so the arms differ only in `speculative.method`.
Streams of recogniser-like chunks (lower case, no punctuation) are sent one chunk at a time, as a live
stream's chunks arrive: each chunk is produced once the previous one's committed result has been read. A
chunk's latency runs from its produce to reading its committed result, on the client's clock. Greedy
corrections must be the same in both arms.

    .venv/bin/python -m bench.asr_latency              # 3 streams x 6 chunks, 2 rounds
    .venv/bin/python -m bench.asr_latency --quick      # 1 stream x 2 chunks, 1 round, to check the script

Writes bench/results/asr_latency.json and its section of docs/perf/speculative.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
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
from bench.speculative import ASR_CHUNKS

ARMS = {"speculation off": None, "prompt lookup on": "prompt_lookup"}


def recogniser_text(chunk: str) -> str:
    """What a recogniser emits before post-correction: lower case, no punctuation."""
    return re.sub(r"[^\w' ]+", "", chunk.lower())


async def _streams(bootstrap: str, topics, streams: int, chunks: int, tag: str) -> list[dict]:
    from schemas import AsrRequest
    from worker.client import RequestProducer, TopicReader, collect_results

    rows = []
    async with TopicReader(bootstrap, topics.results) as results, RequestProducer(bootstrap) as producer:
        for s in range(streams):
            for seq in range(chunks):
                text = recogniser_text(ASR_CHUNKS[(s + seq) % len(ASR_CHUNKS)])
                req = AsrRequest(id=f"asr-{tag}-{s}-{seq}", stream_id=f"st-{tag}-{s}", seq=seq, text=text,
                                 final=seq == chunks - 1)
                t0 = time.perf_counter()
                await producer.send(topics.asr, req, "msgpack")
                await producer.flush()
                got = await collect_results(results, [req.id], timeout_s=120)
                if req.id not in got:
                    raise RuntimeError(f"no committed result for {req.id} within 120 s; see the worker log")
                res = got[req.id][0]
                if res.status != "ok":
                    raise RuntimeError(f"{req.id}: {res.status} {res.error}")
                rows.append({"chunk": f"{s}-{seq}", "ms": (time.perf_counter() - t0) * 1000,
                             "worker_ms": res.timing.total_ms, "tokens": res.usage.completion_tokens,
                             "text": res.text})
    return rows


def run_arm(model: str, method: str | None, streams: int, chunks: int) -> list[dict]:
    from bench.kafka_worker import worker_on_fresh_topics

    with worker_on_fresh_topics(model, "asr-latency",
                                execution={"batch_timeout": "20ms", "async_scheduling": False},
                                speculative={"method": method}) as (_, topics, bootstrap):
        return asyncio.run(_streams(bootstrap, topics, streams, chunks, uuid.uuid4().hex[:8]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one stream of two chunks, one round, to check the script")
    ap.add_argument("--streams", type=int, default=3, help="streams per run, one after another")
    ap.add_argument("--chunks", type=int, default=6, help="chunks per stream, each sent after the last one's result")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per arm; runs are pooled")
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    command = invocation("bench.asr_latency")
    console.print(f"[bold]$ {command}[/]")

    from engine.model_registry import resolve_model

    model = str(resolve_model(args.model))
    streams, chunks, rounds = (1, 2, 1) if args.quick else (args.streams, args.chunks, args.rounds)
    load_at_start = os.getloadavg()[0]
    runs: dict[str, list[list[dict]]] = {arm: [] for arm in ARMS}
    for r in range(rounds):
        for arm, method in ARMS.items():
            with console.status(f"{arm}: {streams} x {chunks} chunks (round {r + 1}/{rounds})..."):
                runs[arm].append(run_arm(model, method, streams, chunks))

    texts = {arm: [[row["text"] for row in run] for run in arm_runs] for arm, arm_runs in runs.items()}
    first = texts["speculation off"][0]
    identical = all(run == first for arm_texts in texts.values() for run in arm_texts)
    headers = ["arm", "chunks", "tokens/chunk", "p50 ms", "p90 ms", "mean ms", "worker mean ms", "mean vs off"]
    rows, summary = [], {}
    for arm, arm_runs in runs.items():
        pooled = [row for run in arm_runs for row in run]
        ms = np.array([row["ms"] for row in pooled])
        worker = np.array([row["worker_ms"] for row in pooled])
        summary[arm] = {"chunks": len(pooled), "p50": float(np.percentile(ms, 50)),
                        "p90": float(np.percentile(ms, 90)), "mean": float(ms.mean()),
                        "worker_mean": float(worker.mean()),
                        "tokens_per_chunk": float(np.mean([row["tokens"] for row in pooled]))}
    off = summary["speculation off"]["mean"]
    for arm, s in summary.items():
        rows.append((arm, s["chunks"], f"{s['tokens_per_chunk']:.1f}", f"{s['p50']:.0f}", f"{s['p90']:.0f}",
                     f"{s['mean']:.0f}", f"{s['worker_mean']:.0f}", f"{s['mean'] / off:.2f}x"))
    title = "ASR chunk latency through Kafka (produce to committed result), SmolLM2-135M fp32"
    print_table(title, headers, rows)
    console.print(f"corrections identical in every run of both arms: {'yes' if identical else 'NO'}")

    data = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average_at_start": load_at_start, "streams": streams, "chunks": chunks, "rounds": rounds,
            "identical": identical, "summary": summary, "runs": runs}
    write_json("asr_latency-quick.json" if args.quick else "asr_latency.json", data)
    if not args.quick:
        update_docs_section("asr_latency", "\n\n".join([
            "### ASR chunk latency through Kafka, speculation off and on",
            f"Measured {data['date']} (load average at start {load_at_start:.1f}). Reproduce with:",
            f"    {command}",
            markdown_table(title, headers, rows),
            f"Corrections identical in every run of both arms: {'yes' if identical else 'no'}. {streams} streams "
            f"of {chunks} recogniser-like chunks (lower case, no punctuation) per run, each chunk sent once the "
            f"last one's committed result was read; {rounds} rounds per arm, alternating, a fresh worker per "
            "run. \"worker mean\" is the worker's own `timing.total_ms` (queueing, prefill and decode).",
        ]), docs=PERF / "speculative.md")


if __name__ == "__main__":
    main()
