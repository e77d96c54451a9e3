"""Dynamic Bucket vs FIFO micro-batching, measured three ways.

    .venv/bin/python bench/batcher.py                 # everything (the engine part takes a few minutes)
    .venv/bin/python bench/batcher.py --skip-engine   # the simulated parts only, under a second

(a) Padding: every flushed batch is costed as a padded static batch, the way
    an engine without continuous batching would run it.
(b) Queueing delay the batcher adds, on a simulated clock.
(c) Our real continuous-batching engine (SmolLM2-135M on the CPU) behind each
    batcher, in real time: requests arrive on a Poisson schedule, the batcher
    releases them, the engine steps continuously. A "direct" row hands each
    request to the engine as it arrives, for reference.

Our engine does not pad, so (a) says nothing about it; (c) is the number that
counts for this project. The script prints what it measured either way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from worker.batcher import Batch, Batcher, BatchItem, DynamicBucketBatcher, FifoBatcher

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOCS = ROOT / "docs" / "perf" / "service.md"
SECTION_BEGIN = "<!-- bench/batcher.py: begin -->"
SECTION_END = "<!-- bench/batcher.py: end -->"
TEXT_SOURCE = Path("/usr/share/common-licenses/GPL-3")


@dataclass
class Request:
    key: str
    arrival: float
    prompt_tokens: int
    max_tokens: int


class SimClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


# Each variant builds a batcher from (max_seq_len, max_batch_size, timeout, clock).
Variant = Callable[[int, int, float, Callable[[], float]], Batcher]
VARIANTS: dict[str, Variant] = {
    "fifo": lambda L, n, t, c: FifoBatcher(n, t, clock=c),
    "dynamic_bucket": lambda L, n, t, c: DynamicBucketBatcher(L, n, t, clock=c),
    # Ablations: without the adaptive cut, and without it and without K-means.
    "dynamic_bucket/no-cut": lambda L, n, t, c: DynamicBucketBatcher(L, n, t, clock=c, adaptive=False),
    "dynamic_bucket/no-cut/fixed-centres": lambda L, n, t, c: DynamicBucketBatcher(
        L, n, t, clock=c, adaptive=False, learn_centres=False),
}


# ---- workloads -------------------------------------------------------------------
def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    return np.cumsum(rng.exponential(1.0 / rate, n))


def mixed_workload(rng: np.random.Generator, n: int, rate: float, max_seq_len: int) -> list[Request]:
    """75% chat (log-normal, median 80 tokens) and 25% documents (Pareto tail from 400 tokens)."""
    arrivals = poisson_arrivals(rng, n, rate)
    max_tokens = np.exp(rng.uniform(math.log(16), math.log(256), n)).astype(int)
    is_doc = rng.random(n) < 0.25
    chat = rng.lognormal(math.log(80), 0.9, n)
    docs = 400 * (1 + rng.pareto(1.5, n))
    prompts = np.where(is_doc, docs, chat).astype(int)
    prompts = np.clip(prompts, 4, max_seq_len - max_tokens)
    return [Request(f"r{i}", float(arrivals[i]), int(prompts[i]), int(max_tokens[i])) for i in range(n)]


def engine_workload(rng: np.random.Generator, n: int, rate: float) -> list[Request]:
    """Prompts of 16-512 tokens: 65% short (log-uniform 16-96), 35% long (uniform 256-512); 16-64 new tokens."""
    arrivals = poisson_arrivals(rng, n, rate)
    short = np.exp(rng.uniform(math.log(16), math.log(96), n))
    long = rng.uniform(256, 512, n)
    prompts = np.where(rng.random(n) < 0.65, short, long).astype(int)
    max_tokens = rng.integers(16, 65, n)
    return [Request(f"e{i}", float(arrivals[i]), int(prompts[i]), int(max_tokens[i])) for i in range(n)]


# ---- (a) and (b): simulated clock ----------------------------------------------
def simulate(variant: Variant, requests: list[Request], max_seq_len: int, max_batch_size: int,
             timeout: float) -> list[tuple[Batch, float]]:
    """Feed arrivals and poll exactly at each advertised deadline; returns (batch, release time)."""
    clock = SimClock()
    batcher = variant(max_seq_len, max_batch_size, timeout, clock)
    released: list[tuple[Batch, float]] = []
    i = 0
    while i < len(requests) or len(batcher):
        deadline = batcher.next_deadline()
        next_arrival = requests[i].arrival if i < len(requests) else math.inf
        if deadline is not None and deadline <= next_arrival:
            clock.t = max(clock.t, deadline)
            batches = batcher.poll()
            if not batches:
                raise RuntimeError("poll() at next_deadline() released nothing")
        else:
            r = requests[i]
            clock.t = r.arrival
            batches = batcher.add(BatchItem(r.key, r.prompt_tokens, r.max_tokens, None, r.arrival))
            i += 1
        released += [(b, clock.t) for b in batches]
    return released


def summarise_sim(released: list[tuple[Batch, float]]) -> dict:
    delays = np.array([t - it.arrival for b, t in released for it in b.items])
    useful = sum(b.useful_tokens for b, _ in released)
    padded = sum(b.padded_tokens for b, _ in released)
    reasons = Counter(b.reason for b, _ in released)
    return {
        "requests": len(delays),
        "batches": len(released),
        "mean_batch_size": len(delays) / len(released),
        "useful_tokens": useful,
        "padded_tokens": padded,
        "wasted_tokens": padded - useful,
        "waste_pct": 100 * (padded - useful) / padded,
        "delay_mean_ms": 1000 * float(delays.mean()),
        "delay_p99_ms": 1000 * float(np.percentile(delays, 99)),
        "reasons": dict(sorted(reasons.items())),
    }


def run_simulation(args) -> list[dict]:
    rows = []
    for rate in args.rates:
        for name, variant in VARIANTS.items():
            released = []
            # Pool several seeds: 256 requests alone make a noisy p99.
            for seed in range(args.seed, args.seed + args.sim_seeds):
                reqs = mixed_workload(np.random.default_rng(seed), args.requests, rate, args.max_seq_len)
                released += simulate(variant, reqs, args.max_seq_len, args.max_batch_size, args.timeout)
            rows.append({"rate": rate, "batcher": name, **summarise_sim(released)})
    return rows


# ---- (c): the real engine in real time -----------------------------------------
def run_engine(llm, name: str, requests: list[Request], prompts: dict[str, list[int]], args) -> dict:
    from engine import SamplingParams

    engine = llm.engine
    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    variant = VARIANTS.get(name)
    batcher = variant(args.engine_max_seq_len, args.max_batch_size, args.timeout, now) if variant else None
    by_key = {r.key: r for r in requests}
    released: dict[str, float] = {}
    first_token: dict[str, float] = {}
    finished: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    batch_sizes: list[int] = []
    steps = 0

    def submit(keys: list[str]) -> None:
        batch_sizes.append(len(keys))
        for key in keys:
            params = SamplingParams(max_tokens=by_key[key].max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(key, prompts[key], params)
            released[key] = now()

    i = 0
    while len(finished) < len(requests):
        t = now()
        out: list[Batch] = []
        while i < len(requests) and requests[i].arrival <= t:
            r = requests[i]
            if batcher is None:
                submit([r.key])
            else:
                out += batcher.add(BatchItem(r.key, r.prompt_tokens, r.max_tokens, None, r.arrival))
            i += 1
        if batcher is not None:
            out += batcher.poll(t)
        for b in out:
            submit([it.key for it in b.items])
        if engine.has_unfinished_requests():
            steps += 1
            for o in engine.step():
                if o.token_ids and o.request_id not in first_token:
                    first_token[o.request_id] = now()
                if o.finished:
                    finished[o.request_id] = now()
                    tokens[o.request_id] = list(o.token_ids)
        else:
            wake = [requests[i].arrival] if i < len(requests) else []
            if batcher is not None and batcher.next_deadline() is not None:
                wake.append(batcher.next_deadline())
            if wake:
                time.sleep(max(0.0, min(wake) - now()))

    arrival = {r.key: r.arrival for r in requests}
    e2e = np.array([finished[k] - arrival[k] for k in arrival])
    ttft = np.array([first_token[k] - arrival[k] for k in arrival])
    held = np.array([released[k] - arrival[k] for k in arrival])
    generated = sum(len(v) for v in tokens.values())
    makespan = max(finished.values()) - min(arrival.values())
    return {
        "batcher": name,
        "requests": len(requests),
        "generated_tokens": generated,
        "prompt_tokens": sum(r.prompt_tokens for r in requests),
        "makespan_s": makespan,
        "output_tok_per_s": generated / makespan,
        "e2e_mean_s": float(e2e.mean()),
        "e2e_p99_s": float(np.percentile(e2e, 99)),
        "ttft_mean_s": float(ttft.mean()),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "held_mean_ms": 1000 * float(held.mean()),
        "held_p99_ms": 1000 * float(np.percentile(held, 99)),
        "engine_steps": steps,
        "handoffs": len(batch_sizes),
        "_tokens": tokens,
    }


def run_engine_part(args) -> tuple[list[dict], dict]:
    from engine import LLM, SamplingParams

    llm = LLM(model="smollm2", dtype="float32", enable_prefix_caching=False)
    text_ids = llm.tokenizer.encode(TEXT_SOURCE.read_text(), add_special_tokens=False)
    rng = np.random.default_rng(args.seed)
    requests = engine_workload(rng, args.engine_requests, args.engine_rate)
    prompts = {}
    for r in requests:
        start = int(rng.integers(0, len(text_ids) - r.prompt_tokens))
        prompts[r.key] = text_ids[start:start + r.prompt_tokens]
    # Warm up kernels and allocators so the first measured run does not pay for them.
    llm.generate([text_ids[:300], text_ids[:40]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    rows = []
    for name in ("direct", "fifo", "dynamic_bucket"):
        load_before = os.getloadavg()[0]
        row = run_engine(llm, name, requests, prompts, args)
        row["loadavg_1m_before"] = load_before
        rows.append(row)
    reference = rows[0].pop("_tokens")
    for row in rows[1:]:
        tokens = row.pop("_tokens")
        row["same_tokens_as_direct"] = sum(tokens[k] == reference[k] for k in reference)
    rows[0]["same_tokens_as_direct"] = len(reference)
    info = {"torch_threads": __import__("torch").get_num_threads(), "cpu_count": os.cpu_count(),
            "prefix_caching": False, "max_model_len": llm.engine.max_model_len}
    return rows, info


# ---- reporting ---------------------------------------------------------------------
def sim_table(rows: list[dict]) -> Table:
    table = Table(title="(a) padding as static batches, (b) queueing delay — simulated clock")
    for col in ("req/s", "batcher", "batches", "mean size", "padded tok", "wasted tok", "waste %",
                "delay mean ms", "delay p99 ms", "flush reasons"):
        table.add_column(col, justify="left" if col in ("batcher", "flush reasons") else "right")
    for r in rows:
        table.add_row(f"{r['rate']:g}", r["batcher"], str(r["batches"]), f"{r['mean_batch_size']:.2f}",
                      f"{r['padded_tokens']:,}", f"{r['wasted_tokens']:,}", f"{r['waste_pct']:.1f}",
                      f"{r['delay_mean_ms']:.1f}", f"{r['delay_p99_ms']:.1f}",
                      " ".join(f"{k}={v}" for k, v in r["reasons"].items()))
    return table


def engine_table(rows: list[dict]) -> Table:
    table = Table(title="(c) real engine (SmolLM2-135M, float32, CPU), real time")
    for col in ("batcher", "out tok/s", "makespan s", "e2e mean s", "e2e p99 s", "TTFT mean s", "TTFT p99 s",
                "held mean ms", "held p99 ms", "hand-offs", "steps", "same tokens", "load 1m"):
        table.add_column(col, justify="left" if col == "batcher" else "right")
    for r in rows:
        table.add_row(r["batcher"], f"{r['output_tok_per_s']:.1f}", f"{r['makespan_s']:.1f}",
                      f"{r['e2e_mean_s']:.2f}", f"{r['e2e_p99_s']:.2f}", f"{r['ttft_mean_s']:.2f}",
                      f"{r['ttft_p99_s']:.2f}", f"{r['held_mean_ms']:.0f}", f"{r['held_p99_ms']:.0f}",
                      str(r["handoffs"]), str(r["engine_steps"]),
                      f"{r['same_tokens_as_direct']}/{r['requests']}", f"{r['loadavg_1m_before']:.2f}")
    return table


def markdown_table(table: Table) -> str:
    headers = [str(c.header) for c in table.columns]
    cells = [list(c.cells) for c in table.columns]
    lines = [f"**{table.title}**", "", "| " + " | ".join(headers) + " |",
             "|" + "|".join("---:" if c.justify == "right" else "---" for c in table.columns) + "|"]
    lines += ["| " + " | ".join(str(col[i]) for col in cells) + " |" for i in range(len(cells[0]))]
    return "\n".join(lines)


def write_markdown(command: str, tables: list[Table], notes: list[str]) -> Path:
    body = "\n\n".join([SECTION_BEGIN, "## Micro-batcher: Dynamic Bucket vs FIFO", f"`{command}`",
                        *(markdown_table(t) for t in tables), "\n".join(f"- {n}" for n in notes), SECTION_END])
    if DOCS.exists():
        doc = DOCS.read_text()
        if SECTION_BEGIN in doc and SECTION_END in doc:
            head, rest = doc.split(SECTION_BEGIN, 1)
            doc = head + body + rest.split(SECTION_END, 1)[1]
        else:
            doc = doc.rstrip("\n") + "\n\n" + body + "\n"
        DOCS.write_text(doc)
        return DOCS
    path = RESULTS / "batcher.md"
    path.write_text(body + "\n")
    return path


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=256, help="simulated requests per seed and rate")
    ap.add_argument("--sim-seeds", type=int, default=5, help="seeds pooled per simulated row")
    ap.add_argument("--rates", type=float, nargs="+", default=[10, 50, 200, 1000], help="simulated req/s")
    ap.add_argument("--max-seq-len", type=int, default=4096, help="for the simulated parts")
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--batch-timeout-ms", type=float, default=50.0)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--engine-requests", type=int, default=64)
    ap.add_argument("--engine-rate", type=float, default=1.0, help="req/s offered to the real engine")
    ap.add_argument("--engine-max-seq-len", type=int, default=1024)
    args = ap.parse_args()
    args.timeout = args.batch_timeout_ms / 1000

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # a log file should not wrap the tables
    command = shlex.join(sys.orig_argv)
    console.print(f"$ {command}   [dim](cwd {os.getcwd()}, commit {git_commit()})[/dim]")
    RESULTS.mkdir(parents=True, exist_ok=True)

    sim_rows = run_simulation(args)
    tables = [sim_table(sim_rows)]
    console.print(tables[0])
    notes = [
        f"Simulated: {args.requests} requests x {args.sim_seeds} seeds per row; 75% chat prompts (log-normal, "
        "median 80 tokens), 25% documents (400 x (1 + Pareto(1.5))), max_tokens log-uniform 16-256, Poisson "
        f"arrivals; max_seq_len {args.max_seq_len}, max_batch_size {args.max_batch_size}, "
        f"batch_timeout {args.batch_timeout_ms:g} ms.",
        "Padded tokens cost each batch as rows of max(prompt) + max(max_tokens), as a static engine pads; "
        "waste % = (padded - useful) / padded. Read it next to mean size: a batch of one has no padding, "
        "so a batcher that stops batching also stops padding. The no-cut rows isolate what grouping by "
        "length does at a comparable batch size; the fixed-centres row turns off K-means as well. "
        "Our engine does continuous batching without padding, so this column is about padded engines, not ours.",
    ]
    engine_rows: list[dict] = []
    engine_info: dict = {}
    if not args.skip_engine:
        console.print(f"(c) running {args.engine_requests} requests through the engine three times ...")
        engine_rows, engine_info = run_engine_part(args)
        tables.append(engine_table(engine_rows))
        console.print(tables[1])
        notes.append(
            f"Engine: {args.engine_requests} requests at {args.engine_rate:g} req/s (Poisson), prompts 16-512 "
            f"tokens cut from {TEXT_SOURCE}, max_tokens 16-64, greedy, ignore_eos; batcher max_seq_len "
            f"{args.engine_max_seq_len}; prefix caching off so no run warms the next; "
            f"{engine_info['torch_threads']} torch threads on {engine_info['cpu_count']} shared CPUs, one run "
            "each, so expect a few percent of noise. 'held' is arrival to hand-off to the engine (the batcher's "
            "wait plus waiting for the current step to end); 'direct' has no batcher.")
    for n in notes:
        console.print(f"- {n}", highlight=False)

    payload = {"command": command, "commit": git_commit(), "args": {k: v for k, v in vars(args).items()},
               "simulated": sim_rows, "engine": engine_rows, "engine_info": engine_info, "notes": notes}
    (RESULTS / "batcher.json").write_text(json.dumps(payload, indent=2) + "\n")
    md = write_markdown(command, tables, notes)
    console.print(f"wrote {RESULTS / 'batcher.json'} and {md}")


if __name__ == "__main__":
    main()
