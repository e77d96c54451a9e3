"""Goodput at a latency SLO: open-loop Poisson arrivals through the real Kafka, at a ladder of rates.

Three systems, one after the other on the same machine, fed the same arrival schedule per rate:
- `ours`: one `infinilm worker` process, streaming on; TTFT from the first delta, TPOT from the deltas,
  end-to-end from the committed result, all on the client's clock;
- `ceiling`: the offline engine in this process, each request added at its arrival time;
- `hf`: a "traditional framework" worker (bench/hf_worker.py): aiokafka + HF `generate` on static
  left-padded batches of up to 16, no streaming, so it is judged on end-to-end latency only.

Goodput is the highest rate of the ladder that meets the SLO (default: MLPerf's llama3.1-8b server limits,
P99 TTFT <= 2 s and P99 TPOT <= 100 ms) with every request answered; the comparison with `hf` uses the
highest rate whose P99 end-to-end latency stays under --e2e-p99 (30 s). A system stops climbing at its first
rate that fails. Past our goodput, a step at twice it shows overload: requests carry a deadline, and every one
must still be answered exactly once.

    .venv/bin/python -m bench.slo                      # the full ladder, about 25 minutes
    .venv/bin/python -m bench.slo --quick              # two low rates, a few requests, to check the script
    .venv/bin/python -m bench.slo --batchers dynamic_bucket,fifo   # our worker once per batcher
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.kafka_e2e import ENGINE, build_workload
from bench.report import (
    PERF,
    console,
    invocation,
    markdown_table,
    print_table,
    update_docs_section,
    write_json,
)


@dataclass(frozen=True)
class Slo:
    ttft_p99_s: float = 2.0
    tpot_p99_s: float = 0.100
    e2e_p99_s: float = 30.0


@dataclass
class Timings:
    """One request's times on the client's clock, in seconds from when it was sent (None: never seen);
    `sent` is when that was, in seconds from the step's start."""

    sent: float = 0.0
    first_token: float | None = None
    last_token: float | None = None
    done: float | None = None
    tokens: int = 0
    error: str | None = None


@dataclass
class Step:
    """One system at one rate."""

    system: str
    rate: float
    wall_s: float
    timings: dict[str, Timings] = field(default_factory=dict)
    lag: float | None = None

    def answered(self) -> list[Timings]:
        return [t for t in self.timings.values() if t.done is not None]

    def p(self, q: float, what: str) -> float | None:
        values = [v for v in (getattr_metric(t, what) for t in self.answered() if t.error is None) if v is not None]
        return float(np.percentile(values, q)) if values else None

    def all_answered(self) -> bool:
        return len(self.answered()) == len(self.timings)

    def clean(self) -> bool:
        """Every request answered, none with an error."""
        return self.all_answered() and not any(t.error for t in self.timings.values())

    def meets(self, slo: Slo) -> bool:
        """Clean, and the streamed limits held: P99 TTFT and P99 TPOT."""
        return self.clean() and (self.p(99, "ttft") or 0.0) <= slo.ttft_p99_s \
            and (self.p(99, "tpot") or 0.0) <= slo.tpot_p99_s

    def meets_e2e(self, slo: Slo) -> bool:
        """Clean, and P99 end-to-end latency within its limit (the comparison with a non-streaming worker)."""
        return self.clean() and (self.p(99, "e2e") or 0.0) <= slo.e2e_p99_s

    def row(self) -> list:
        answered = self.answered()
        tokens = sum(t.tokens for t in answered)
        span = max((t.sent + t.done for t in answered), default=0.0) or self.wall_s

        def ms(q, what):
            v = self.p(q, what)
            return "—" if v is None else f"{v * 1000:.0f}"

        return [self.system, f"{self.rate:g}", f"{len(answered) / span:.2f}" if span else "—",
                f"{tokens / span:.1f}" if span else "—", ms(50, "ttft"), ms(99, "ttft"), ms(50, "tpot"),
                ms(99, "tpot"), ms(50, "e2e"), ms(99, "e2e"), f"{len(answered)}/{len(self.timings)}",
                sum(1 for t in self.timings.values() if t.error), "—" if self.lag is None else f"{self.lag:.0f}"]


ROW_HEADERS = ["system", "rate req/s", "got req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
               "TPOT p99 ms", "E2E p50 ms", "E2E p99 ms", "answered", "errors", "lag end"]


def getattr_metric(t: Timings, what: str) -> float | None:
    if what == "ttft":
        return t.first_token
    if what == "e2e":
        return t.done
    if what == "tpot":
        if t.first_token is None or t.last_token is None or t.tokens < 2:
            return None
        return (t.last_token - t.first_token) / (t.tokens - 1)
    raise ValueError(what)


def arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Poisson arrivals: `n` send times (seconds from the start) with exponential gaps of mean 1/rate."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def step_of(tag: str) -> str:
    """The step part of a workload tag ('dynamic_bucket-1.5' -> '1.5', 'hf-overload' -> 'overload'): what
    decides the prompts, so every system at one step is fed the same ones."""
    return tag.rsplit("-", 1)[-1]


def goodput(steps: list[Step], ok) -> float:
    """The highest rate whose step passes `ok`, 0 when none does."""
    return max((s.rate for s in steps if ok(s)), default=0.0)


# ---- the three systems ---------------------------------------------------------------------------


def run_ceiling(model: str, workload: list[dict], schedule: list[float], rate: float, drain_s: float) -> Step:
    """The offline engine fed the same schedule in-process: each request added once its arrival time passed."""
    from engine import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", **ENGINE)
    engine, tok = llm.engine, llm.tokenizer
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    prompts = [tok.encode(tok.apply_chat_template(r["messages"]), add_special_tokens=False) for r in workload]
    step = Step("ceiling", rate, 0.0, {r["id"]: Timings(sent=at) for r, at in zip(workload, schedule, strict=True)})
    arrival = {r["id"]: at for r, at in zip(workload, schedule, strict=True)}
    t0, nxt = time.monotonic(), 0
    deadline = schedule[-1] + drain_s
    while (nxt < len(workload) or engine.has_unfinished_requests()) and time.monotonic() - t0 < deadline:
        now = time.monotonic() - t0
        while nxt < len(workload) and schedule[nxt] <= now:
            r = workload[nxt]
            engine.add_request(r["id"], prompts[nxt], SamplingParams(max_tokens=r["max_tokens"], temperature=0.0))
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, schedule[nxt] - now))
            continue
        for out in engine.step():
            t = step.timings[out.request_id]
            at = time.monotonic() - t0 - arrival[out.request_id]
            if out.token_ids:
                t.first_token = t.first_token if t.first_token is not None else at
                t.last_token, t.tokens = at, len(out.token_ids)
            if out.finished:
                t.done = at
    step.wall_s = time.monotonic() - t0
    return step


async def _drive(bootstrap: str, topics, workload: list[dict], schedule: list[float], system: str, rate: float,
                 drain_s: float, deadline_s: float | None, stream: bool) -> Step:
    """Send each request at its arrival time, never waiting for answers, while reading deltas and results."""
    import msgpack

    from schemas import ChatRequest, Message
    from worker.client import RequestProducer, TopicReader

    step = Step(system, rate, 0.0, {r["id"]: Timings() for r in workload})
    sent: dict[str, float] = {}
    async with (TopicReader(bootstrap, topics.results) as results, TopicReader(bootstrap, topics.deltas) as deltas,
                RequestProducer(bootstrap) as producer):
        t0 = time.monotonic()

        async def send_all():
            for r, at in zip(workload, schedule, strict=True):
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                deadline = None if deadline_s is None else int((time.time() + deadline_s) * 1000)
                req = ChatRequest(id=r["id"], messages=[Message(**m) for m in r["messages"]],
                                  max_tokens=r["max_tokens"], temperature=0.0, stream=stream,
                                  deadline_ms=deadline)
                sent[r["id"]] = time.monotonic()
                step.timings[r["id"]].sent = sent[r["id"]] - t0
                await producer.send(topics.chat, req, "msgpack")

        async def read(reader, on_value):
            while len(step.answered()) < len(workload) and time.monotonic() - t0 < schedule[-1] + drain_s:
                for rec in await reader.poll(100):
                    now = time.monotonic()
                    value = msgpack.unpackb(rec.value, raw=False)
                    if value.get("id") in sent:
                        on_value(value, now - sent[value["id"]])

        def on_delta(d, at):
            t = step.timings[d["id"]]
            if d.get("text") or d.get("finished"):
                t.first_token = t.first_token if t.first_token is not None else at
                t.last_token = at

        def on_result(res, at):
            t = step.timings[res["id"]]
            if t.done is not None:
                t.error = "duplicate"
                return
            t.done = at
            t.tokens = res.get("usage", {}).get("completion_tokens", 0)
            if res.get("status") != "ok":
                t.error = (res.get("error") or {}).get("code", "error")

        sender = asyncio.create_task(send_all())
        await asyncio.gather(read(results, on_result), *([read(deltas, on_delta)] if stream else []))
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender
        step.wall_s = time.monotonic() - t0
    return step


def consumer_lag(worker) -> float | None:
    """The worker's summed `infinilm_consumer_lag` (records not yet consumed), from its metrics endpoint."""
    try:
        text = worker.metrics()
    except Exception:
        return None
    values = [float(m[1]) for m in re.finditer(r"^infinilm_consumer_lag\{[^}]*\} (\S+)$", text, re.M)]
    return sum(values) if values else None


def run_ours(model: str, batcher: str, ladder, make_workload, drain_s: float, slo: Slo,
             overload: bool) -> list[Step]:
    from bench.kafka_worker import worker_on_fresh_topics

    steps: list[Step] = []
    sections = dict(execution={"max_num_seqs": ENGINE["max_num_seqs"], "batcher": batcher,
                               "max_num_batched_tokens": ENGINE["max_num_batched_tokens"]},
                    memory={"kv_cache_bytes": ENGINE["kv_cache_memory_bytes"]})
    name = f"ours:{batcher}"
    with worker_on_fresh_topics(model, "slo", **sections) as (worker, topics, bootstrap):
        for rate in ladder:
            workload, schedule = make_workload(rate, f"{batcher}-{rate:g}")
            with console.status(f"{name} at {rate:g} req/s ({len(workload)} requests)..."):
                step = asyncio.run(_drive(bootstrap, topics, workload, schedule, name, rate, drain_s, None, True))
            step.lag = consumer_lag(worker)
            steps.append(step)
            print_table(f"{name} at {rate:g} req/s", ROW_HEADERS, [step.row()])
            if not step.meets(slo):
                break
        best = goodput(steps, lambda s: s.meets(slo))
        if overload and best > 0:
            rate = 2 * best
            workload, schedule = make_workload(rate, f"{batcher}-overload")
            with console.status(f"{name} overload at {rate:g} req/s..."):
                step = asyncio.run(_drive(bootstrap, topics, workload, schedule, f"{name} overload", rate,
                                          drain_s, slo.e2e_p99_s, True))
            step.lag = consumer_lag(worker)
            steps.append(step)
    return steps


def run_hf(model: str, ladder, make_workload, drain_s: float, slo: Slo) -> list[Step]:
    from bench.kafka_worker import fresh_topics

    steps: list[Step] = []
    with fresh_topics("slo-hf") as (topics, bootstrap):
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.hf_worker", "--bootstrap", bootstrap, "--requests", topics.chat,
             "--results", topics.results, "--group", f"{topics.chat}.hf", "--model", model],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            line = proc.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"the HF worker did not start: {line}{proc.stdout.read()[-2000:]}")
            for rate in ladder:
                workload, schedule = make_workload(rate, f"hf-{rate:g}")
                with console.status(f"hf at {rate:g} req/s ({len(workload)} requests)..."):
                    step = asyncio.run(_drive(bootstrap, topics, workload, schedule, "hf", rate, drain_s, None,
                                              False))
                steps.append(step)
                print_table(f"hf at {rate:g} req/s", ROW_HEADERS, [step.row()])
                if not step.meets_e2e(slo):
                    break
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return steps


# ---- the command ---------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="rates 0.25 and 0.5, 4 requests each, to check the script")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rates", default="0.25,0.5,1,1.5,2,3", help="the ladder, req/s, comma-separated")
    ap.add_argument("--hf-rates", default="0.1,0.2,0.3,0.5,0.75,1", help="the HF worker's ladder")
    ap.add_argument("--duration", type=float, default=50.0, help="seconds of arrivals per rate")
    ap.add_argument("--drain", type=float, default=120.0, help="seconds after the last arrival to wait for answers")
    ap.add_argument("--ttft-p99", type=float, default=2.0, help="SLO: P99 time to first token, seconds")
    ap.add_argument("--tpot-p99", type=float, default=0.100, help="SLO: P99 time per output token, seconds")
    ap.add_argument("--e2e-p99", type=float, default=30.0, help="the end-to-end P99 limit for the HF comparison")
    ap.add_argument("--batchers", default="dynamic_bucket",
                    help="our worker's batcher(s), comma-separated: dynamic_bucket, fifo, direct")
    ap.add_argument("--no-overload", action="store_true", help="skip the step at twice our goodput")
    ap.add_argument("--systems", default="ours,ceiling,hf", help="which systems to run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="no run: report the steps of saved runs (bench/results/slo*.json) together; a system "
                         "in a later file replaces the same system's steps from earlier ones")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    command = invocation("bench.slo")
    console.print(f"[bold]$ {command}[/]")
    if args.merge:
        merged, slo = merge_runs([Path(f) for f in args.merge])
        report(merged, slo, command, args)
        return

    from engine.model_registry import resolve_model
    from engine.tokenizer import Tokenizer

    model = str(resolve_model(args.model))
    tokenizer = Tokenizer(Path(model))
    slo = Slo(args.ttft_p99, args.tpot_p99, args.e2e_p99)
    rates = [0.25, 0.5] if args.quick else [float(r) for r in args.rates.split(",")]
    hf_rates = [0.25, 0.5] if args.quick else [float(r) for r in args.hf_rates.split(",")]
    prompt_range, output_range = ((32, 96), (8, 16)) if args.quick else ((56, 329), (32, 128))

    def make_workload(rate: float, tag: str) -> tuple[list[dict], list[float]]:
        n = 4 if args.quick else max(8, round(rate * args.duration))
        # Fresh text per step: one worker serves the whole ladder, and prompts repeated from an earlier step
        # would hit its prefix cache while the ceiling's engine (new per step) starts cold. Systems at the
        # same step still get the same prompts.
        text_seed = zlib.crc32(f"{args.seed}:{step_of(tag)}".encode())
        workload = build_workload(tokenizer, n, text_seed, prompt_range, output_range)
        for i, r in enumerate(workload):
            r["id"] = f"slo-{tag}-{i}"
        return workload, arrivals(rate, n, args.seed)

    systems = set(args.systems.split(","))
    steps: list[Step] = []
    if "ours" in systems:
        for batcher in args.batchers.split(","):
            steps += run_ours(model, batcher, rates, make_workload, args.drain, slo,
                              overload=not (args.quick or args.no_overload))
    if "ceiling" in systems:
        for rate in rates:
            workload, schedule = make_workload(rate, f"ceiling-{rate:g}")
            with console.status(f"ceiling at {rate:g} req/s..."):
                step = run_ceiling(model, workload, schedule, rate, args.drain)
            steps.append(step)
            if not step.meets(slo):
                break
    if "hf" in systems:
        steps += run_hf(model, hf_rates, make_workload, args.drain, slo)
    report(steps, slo, command, args)


def merge_runs(paths: list[Path]) -> tuple[list[Step], Slo]:
    """The steps of saved runs, a later file's systems replacing an earlier one's; the last file's SLO."""
    import json

    by_system: dict[str, list[Step]] = {}
    slo = Slo()
    for path in paths:
        data = json.loads(path.read_text())
        slo = Slo(**data["slo"])
        systems: dict[str, list[Step]] = {}
        for s in data["steps"]:
            systems.setdefault(s["system"], []).append(Step(
                s["system"], s["rate"], s["wall_s"], {k: Timings(**t) for k, t in s["timings"].items()}, s["lag"]))
        by_system.update(systems)
    return [step for steps in by_system.values() for step in steps], slo


def report(steps: list[Step], slo: Slo, command: str, args) -> None:
    rows = [s.row() for s in steps]
    title = (f"Poisson arrivals, SmolLM2-135M fp32, SLO P99 TTFT <= {slo.ttft_p99_s:g} s, "
             f"P99 TPOT <= {slo.tpot_p99_s * 1000:g} ms")
    print_table(title, ROW_HEADERS, rows)
    systems = sorted({s.system for s in steps if "overload" not in s.system})
    summary = []
    for system in systems:
        mine = [s for s in steps if s.system == system]
        streamed = system != "hf"
        slo_rate = goodput(mine, lambda s: s.meets(slo)) if streamed else None
        e2e_rate = goodput(mine, lambda s: s.meets_e2e(slo))
        at = next((s for s in mine if s.rate == slo_rate), None)
        ttft = at.p(99, "ttft") if at is not None else None
        summary.append([system, "—" if slo_rate is None else f"{slo_rate:g}", f"{e2e_rate:g}",
                        "—" if ttft is None else f"{ttft * 1000:.0f}"])
    sum_headers = ["system", "goodput req/s (TTFT+TPOT SLO)", f"rate at P99 E2E <= {slo.e2e_p99_s:g} s",
                   "P99 TTFT at goodput, ms"]
    print_table("goodput", sum_headers, summary)
    data = {"command": command, "date": time.strftime("%Y-%m-%d"), "slo": slo.__dict__, "load_average": os.getloadavg(),
            "steps": [{"system": s.system, "rate": s.rate, "wall_s": s.wall_s, "lag": s.lag,
                       "timings": {k: t.__dict__ for k, t in s.timings.items()}} for s in steps]}
    write_json("slo-quick.json" if args.quick else "slo.json", data)
    if not args.quick:
        update_docs_section("slo", "\n\n".join([
            "## Goodput at a latency SLO through Kafka",
            f"Measured {data['date']}. Reproduce with:", f"    {command}",
            markdown_table("goodput", sum_headers, summary), markdown_table(title, ROW_HEADERS, rows),
        ]), docs=PERF / "service.md")


if __name__ == "__main__":
    main()
