"""Offline throughput of the engine against HF transformers, and against the CPU roofline.

Run from the repository root on a quiet machine:

    .venv/bin/python -m bench.throughput            # full run: JSON + docs/perf/cpu-engine.md
    .venv/bin/python -m bench.throughput --quick    # smoke run: bench/results/throughput-quick.json only
    .venv/bin/python -m bench.throughput --profile  # the engine's part under torch.profiler

Everything runs in one process, one system after the other, with the same
thread count, so the systems see the same machine. One-time costs (model
load, the C++ kernel build, warm-up) are timed apart from the measured runs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shlex
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may download; fail instead

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.report import isa_path, markdown_table, print_table
from engine import LLM, SamplingParams
from engine.model_registry import resolve_model
from engine.models.config import ModelConfig

try:
    from bench import roofline
except ImportError:  # run as `python bench/throughput.py`: bench/ itself is on sys.path
    import roofline

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
DOCS = REPO / "docs" / "perf" / "cpu-engine.md"
TEXT = Path("/usr/share/common-licenses/GPL-3")
START, END = "<!-- throughput:start -->", "<!-- throughput:end -->"
# A log file gets wide tables; a terminal keeps its own width.
console = Console(width=None if sys.stdout.isatty() else 132)


@dataclass(frozen=True)
class Settings:
    num_requests: int = 64
    prompt_lens: tuple[int, int] = (32, 512)
    output_lens: tuple[int, int] = (32, 256)
    hf_batch_size: int = 16
    decode_min_batch: int = 32
    single_prompt: int = 128
    single_output: int = 128
    single_rounds: int = 5
    ttft_prefix: int = 1024
    ttft_suffix: int = 32
    ttft_repeats: int = 5
    machine_repeats: int = 5


QUICK = Settings(num_requests=8, prompt_lens=(32, 128), output_lens=(16, 64), hf_batch_size=4, decode_min_batch=4,
                 single_prompt=64, single_output=32, ttft_prefix=256, ttft_suffix=16, ttft_repeats=2,
                 machine_repeats=2)


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def build_workload(text_ids: list[int], s: Settings, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    prompts, outs, offsets = [], [], set()
    for _ in range(s.num_requests):
        length = int(rng.integers(s.prompt_lens[0], s.prompt_lens[1] + 1))
        # Two prompts from one offset would share KV blocks, and the engine's prefix cache would
        # skip work the static-batch peer must do; distinct offsets keep the work the same.
        offset = int(rng.integers(0, len(text_ids) - length + 1))
        while offset in offsets:
            offset = int(rng.integers(0, len(text_ids) - length + 1))
        offsets.add(offset)
        prompts.append(text_ids[offset:offset + length])
        outs.append(int(rng.integers(s.output_lens[0], s.output_lens[1] + 1)))
    return Workload(prompts, outs)


@contextlib.contextmanager
def progress_bar(description: str, total: int) -> Iterator:
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=console, transient=True, disable=not console.is_terminal)
    task = bar.add_task(description, total=total)
    t0 = time.perf_counter()
    with bar:
        yield lambda n=1: bar.advance(task, n)
    console.print(f"{description}: {time.perf_counter() - t0:.1f} s")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


# ---- our engine --------------------------------------------------------------------------------


@dataclass
class EngineRun:
    outputs: list[list[int]]
    wall_s: float
    num_cached_tokens: list[int]  # per request: prompt tokens the prefix cache served
    num_preemptions: int
    # per step: (seconds, prefill tokens, decode sequences, summed decode context; 0 unless pure decode)
    steps: list[tuple[float, int, int, int]] = field(default_factory=list)


def run_engine(llm: LLM, w: Workload, tag: str = "tp") -> EngineRun:
    engine = llm.engine
    ids = [f"{tag}-{i}" for i in range(len(w.prompts))]
    done: dict[str, object] = {}
    steps = []
    preempted_before = engine.scheduler.num_preemptions
    with progress_bar("engine", w.num_output_tokens) as advance:
        t0 = time.perf_counter()
        for rid, prompt, n in zip(ids, w.prompts, w.output_lens, strict=True):
            engine.add_request(rid, prompt, greedy(n))
        while engine.has_unfinished_requests():
            outs = engine.step()
            st = engine.last_stats
            # In a decode-only step every output is one decode, and it attended to the prompt and
            # all earlier outputs: len(prompt) + len(outputs) - 1 tokens (its own input included).
            context = 0
            if not st.step_prefill_tokens:
                context = sum(len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in outs)
            steps.append((st.step_time_s, st.step_prefill_tokens, st.step_decode_seqs, context))
            for o in outs:
                if o.error is not None:
                    raise RuntimeError(f"engine request {o.request_id} failed: {o.error}")
                advance(len(o.new_token_ids))
                if o.finished:
                    done[o.request_id] = o
        wall = time.perf_counter() - t0
    outputs = [done[rid] for rid in ids]
    return EngineRun([list(o.token_ids) for o in outputs], wall, [max(o.num_cached_tokens, 0) for o in outputs],
                     engine.scheduler.num_preemptions - preempted_before, steps)


def run_single_stream(llm: LLM, prompt: list[int], n: int) -> dict:
    engine = llm.engine
    engine.block_manager.reset_prefix_cache()  # the prompt must not ride on the throughput run's blocks
    engine.add_request("single", prompt, greedy(n))
    stamps = []
    while engine.has_unfinished_requests():
        if engine.step():
            stamps.append(time.perf_counter())
    # The first stamp ends the prefill; the rest are one decode step each.
    decode_s = stamps[-1] - stamps[0]
    return {"prompt_tokens": len(prompt), "output_tokens": n, "decode_s": decode_s,
            "decode_tok_s": (len(stamps) - 1) / decode_s}


def run_single_stream_rounds(llm: LLM, prompt: list[int], n: int, rounds: int,
                             read_probe: Callable[[], float] | None = None) -> dict:
    """run_single_stream `rounds` times (median by tok/s); where the model runs decode-only steps in one
    C++ call (decode_layers), also with that off, alternating, as `layer_by_layer`. With `read_probe`
    (roofline.ReadProbe), each engine round also records `read_gbps`, the better of the read rates measured
    right before and right after it: its own memory floor (analyse: single_stream_paired_share)."""
    model = llm.engine.model
    fused = model.fused_decoder
    arms = {"engine": [], "layer_by_layer": []} if fused is not None else {"engine": []}
    try:
        for _ in range(rounds):
            for arm, runs in arms.items():
                model.fused_decoder = fused if arm == "engine" else None
                before = read_probe() if read_probe and arm == "engine" else None
                runs.append(run_single_stream(llm, prompt, n))
                if before is not None:
                    runs[-1]["read_gbps"] = max(before, read_probe())
    finally:
        model.fused_decoder = fused

    def median(runs: list[dict]) -> dict:
        out = {**sorted(runs, key=lambda x: x["decode_tok_s"])[len(runs) // 2],
               "rounds_tok_s": [x["decode_tok_s"] for x in runs]}
        if any("read_gbps" in x for x in runs):
            out["rounds"] = [{"decode_tok_s": x["decode_tok_s"], "read_gbps": x["read_gbps"]} for x in runs]
        return out

    out = median(arms["engine"])
    if "layer_by_layer" in arms:
        out["layer_by_layer"] = median(arms["layer_by_layer"])
    return out


def pages_note(r: dict) -> str:
    """How the run's headline engine kept its weights: `huge_pages` "auto" (the default from 2026-12-05 18:25
    UTC; runs before it record nothing and ran with huge pages off)."""
    setting = r.get("engine", {}).get("huge_pages", False)
    if setting == "auto":
        return ("The headline engine runs with the defaults' `huge_pages: auto`: the weights a decode step streams "
                "in huge pages (with a bounded start-up cost), its KV cache in torch's 4 KiB pages.")
    if setting is True:
        return "The headline engine runs with `huge_pages: true`: its decode-streamed weights and KV cache in huge pages."
    return "The headline engine keeps torch's 4 KiB pages (`huge_pages` off, the default of that run's day)."


def decode_weight_bytes(model) -> int:
    """Weight bytes one decode step reads: each linear's packed copy where it has one (else its weight and
    bias), the LM head's likewise, and the norms; one row of the embedding table per token is left out."""
    from engine.models.linear import Linear, packed_bytes

    total = 0
    for module in model.modules():
        if isinstance(module, Linear):
            total += packed_bytes(module.packed, module.weight) if module.packed is not None else \
                module.weight.numel() * module.weight.element_size()
            total += module.bias.numel() * module.bias.element_size() if module.bias is not None else 0
    head = model.embed_tokens
    if model.lm_head is None:
        total += packed_bytes(head.packed_head, head.weight) if head.packed_head is not None else \
            head.weight.numel() * head.weight.element_size()
    norms = [p for name, p in model.named_parameters() if name.endswith("norm.weight")]
    return total + sum(p.numel() * p.element_size() for p in norms)


def time_to_first_token(llm: LLM, rid: str, prompt: list[int]) -> tuple[float, int]:
    engine = llm.engine
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, greedy(1))
    ttft, cached = None, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.token_ids and ttft is None:
                ttft, cached = time.perf_counter() - t0, o.num_cached_tokens
    return ttft, cached


def run_ttft(llm: LLM, text_ids: list[int], s: Settings, seed: int) -> dict:
    rng = np.random.default_rng(seed + 1)
    prefix = text_ids[:s.ttft_prefix]

    def suffix() -> list[int]:  # a different short user turn each time, from past the prefix
        offset = int(rng.integers(s.ttft_prefix, len(text_ids) - s.ttft_suffix))
        return text_ids[offset:offset + s.ttft_suffix]

    cold, cached, hits = [], [], []
    with progress_bar("TTFT", s.ttft_repeats) as advance:
        for i in range(s.ttft_repeats):
            if not llm.engine.block_manager.reset_prefix_cache():
                raise RuntimeError("the prefix cache can only be reset while the engine is idle")
            cold.append(time_to_first_token(llm, f"cold-{i}", prefix + suffix())[0])
            t, hit = time_to_first_token(llm, f"cached-{i}", prefix + suffix())
            cached.append(t)
            hits.append(hit)
            advance()
    cold_s, cached_s = statistics.median(cold), statistics.median(cached)
    return {"prefix_tokens": s.ttft_prefix, "suffix_tokens": s.ttft_suffix, "repeats": s.ttft_repeats,
            "cold_s": cold, "cached_s": cached, "cached_prefix_hit_tokens": hits,
            "cold_median_s": cold_s, "cached_median_s": cached_s, "speedup": cold_s / cached_s}


# ---- HF transformers peers -------------------------------------------------------------------


def load_hf(path: Path):
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="sdpa").eval()


@torch.inference_mode()
def run_hf_static(model, w: Workload, batch_size: int, eos: int) -> tuple[list[list[int]], float, int]:
    """Left-padded static batches; each batch runs to its longest request. Returns (outputs, wall, tokens computed)."""

    def generate(prompts: list[list[int]], n: int) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), eos, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        # min_new_tokens == max_new_tokens keeps EOS from ending a row early, like ignore_eos.
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=eos, eos_token_id=eos)
        return out[:, width:]

    generate([w.prompts[0][:8]], 4)  # warm-up: first-call allocations and dispatch
    outputs, computed = [], 0
    with progress_bar("HF static batches", len(w.prompts)) as advance:
        t0 = time.perf_counter()
        for start in range(0, len(w.prompts), batch_size):
            prompts, lens = w.prompts[start:start + batch_size], w.output_lens[start:start + batch_size]
            new = generate(prompts, max(lens))
            outputs.extend(new[row, :n].tolist() for row, n in enumerate(lens))
            computed += new.numel()
            advance(len(prompts))
        wall = time.perf_counter() - t0
    return outputs, wall, computed


def run_hf_continuous(model, w: Workload, eos: int, attn: str, max_batch_tokens: int,
                      max_seqs: int) -> tuple[list[list[int]], float]:
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    if attn != model.config._attn_implementation:
        model.set_attn_implementation(attn)
    page = ContinuousBatchingConfig().page_size
    cb_config = ContinuousBatchingConfig(
        auto_switch_to_flash=False,  # no flash attention on a CPU
        # Room for the whole workload at once, as the engine gets, so neither side queues on memory.
        num_blocks=sum(-(-(len(p) + n) // page) for p, n in zip(w.prompts, w.output_lens, strict=True)) + 1,
        max_batch_tokens=max_batch_tokens, max_requests_per_batch=max_seqs)
    hints = WorkloadHints(max(map(len, w.prompts)), max(w.output_lens), len(w.prompts))
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(w.output_lens), eos_token_id=-1,
                                  pad_token_id=eos)
    results = {}

    def wait_for(count: int, advance=lambda: None) -> None:
        while len(results) < count:
            r = manager.get_result(timeout=30)
            if r is None:
                if not manager.is_running():
                    raise RuntimeError("the HF continuous-batching thread stopped")
                continue
            if r.is_finished():
                if r.error is not None:
                    raise RuntimeError(f"HF continuous batching failed request {r.request_id}: {r.error}")
                results[r.request_id] = r.generated_tokens
                advance()

    with torch.inference_mode(), model.continuous_batching_context_manager(
            generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=5,
            workload_hints=hints) as manager:
        # A negative eos_token_id is dropped from the request's stop set: the request ignores EOS.
        manager.add_request(w.prompts[0][:8], request_id="warmup", max_new_tokens=4, eos_token_id=-1)
        wait_for(1)
        with progress_bar("HF continuous batching", len(w.prompts)) as advance:
            t0 = time.perf_counter()
            for i, (p, n) in enumerate(zip(w.prompts, w.output_lens, strict=True)):
                manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
            wait_for(len(w.prompts) + 1, advance)
            wall = time.perf_counter() - t0
    return [results[f"r{i}"] for i in range(len(w.prompts))], wall


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How far the peer's greedy tokens follow ours: fp32 kernels differ, so near-ties diverge late."""
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    prefix = 0
    for a, b in zip(ours, theirs, strict=True):
        prefix += next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return {"identical_requests": same, "common_prefix_share": prefix / sum(map(len, ours))}


# ---- profile ---------------------------------------------------------------------------------


@contextlib.contextmanager
def phase_timers(llm: LLM) -> Iterator[dict[str, float]]:
    """Wrap the engine's step phases so the profile says where wall time goes, Python included."""
    import engine.model_runner as model_runner
    from engine.kernels.cpu_build import kernels_available, load_kernels

    engine = llm.engine
    totals: dict[str, float] = defaultdict(float)
    targets = {"schedule": (engine.scheduler, "schedule"), "prepare inputs": (engine.runner, "_prepare"),
               "model forward": (engine.runner.model, "forward"), "lm head": (engine.runner.model, "compute_logits"),
               "sample": (model_runner, "sample_on_device"), "scheduler update": (engine.scheduler, "update"),
               "outputs/detokenize": (engine.output_processor, "process_run")}

    def timed(name, fn):
        def call(*args, **kwargs):
            with torch.profiler.record_function(name):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    totals[name] += time.perf_counter() - t0
        return call

    def labelled(name, fn):
        def call(*args, **kwargs):
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)
        return call

    # The C++ kernels are plain pybind functions, invisible to the profiler; without a label their
    # time lands in the self time of whatever called them. They run inside "model forward", so
    # they get a label but no wall total of their own.
    kernels = {}
    if kernels_available():
        ops = load_kernels()
        kernels = {f"ext::{n}": (ops, n) for n in ("paged_decode_attention", "paged_prefill_attention",
                                                   "skinny_linear", "panel_linear", "rms_norm_rows",
                                                   "add_rms_norm_rows", "rope_rows_", "silu_mul_rows_", "decode_layers")}
    originals = {name: getattr(obj, attr) for name, (obj, attr) in {**targets, **kernels}.items()}
    for name, (obj, attr) in targets.items():
        setattr(obj, attr, timed(name, originals[name]))
    for name, (obj, attr) in kernels.items():
        setattr(obj, attr, labelled(name, originals[name]))
    try:
        yield totals
    finally:
        for name, (obj, attr) in {**targets, **kernels}.items():
            setattr(obj, attr, originals[name])


def profile_engine(llm: LLM, w: Workload, out_path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    with phase_timers(llm) as totals, profile(activities=[ProfilerActivity.CPU]) as prof:
        run = run_engine(llm, w, tag="prof")
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50)
    rows = [(name, f"{t:.3f}", f"{100 * t / run.wall_s:.1f}%") for name, t in sorted(totals.items(), key=lambda x: -x[1])]
    other = run.wall_s - sum(totals.values())
    rows.append(("other (engine loop, bookkeeping)", f"{other:.3f}", f"{100 * other / run.wall_s:.1f}%"))
    phases = ("Engine phases under the profiler (its overhead included)",
              ["phase", "seconds", "share of wall"], rows)
    print_table(*phases)
    print(ops)  # already a fixed-width table; rich would re-wrap it
    out_path.write_text(markdown_table(*phases) + "\n\nTop ops by self CPU time:\n\n" + ops + "\n")
    console.print(f"wrote {out_path.relative_to(REPO)}")


# ---- report ----------------------------------------------------------------------------------


def analyse(r: dict, flops: roofline.FlopModel, weight_bytes: int, kv_token_bytes: int, s: Settings) -> dict:
    """Roofline shares from the raw measurements in `r`."""
    rates, eng = r["machine_rates"], r["engine"]
    peak = rates["peak_gflops"] * 1e9
    # Tokens the prefix cache served were not computed; count only work that was done.
    total = sum(flops.request(p, n, c) for p, n, c in zip(r["workload"]["prompt_lens"], r["workload"]["output_lens"],
                                                          eng["num_cached_tokens"], strict=True))
    roof_s = total / peak
    dec = [st for st in eng["steps"] if st[1] == 0 and st[2] >= s.decode_min_batch]
    dec_flops = sum(flops.decode_step(n, ctx) for _, _, n, ctx in dec)
    dec_s, dec_tokens = sum(st[0] for st in dec), sum(st[2] for st in dec)
    # The attainable roof for decode also counts bytes: every step streams the weights and the KV it attends to.
    bandwidth = rates["read_gbps"] * 1e9
    dec_floor = sum(max(flops.decode_step(n, ctx) / peak, (weight_bytes + ctx * kv_token_bytes) / bandwidth)
                    for _, _, n, ctx in dec)
    floor_step = weight_bytes / bandwidth

    def serial_step(n: int, ctx: int) -> float:
        return roofline.DecodeStepTimes.of(flops, n, ctx, weight_bytes, kv_token_bytes, peak, bandwidth).in_turns

    dec_serial = sum(serial_step(n, ctx) for _, _, n, ctx in dec)
    # With every read hidden behind the arithmetic, a step still takes the longer of its compute and its memory
    # time (dec_floor): where the bytes take longer, no kernel reaches the compute roof, whatever it overlaps.
    overlap_extra = sum(max(0.0, (weight_bytes + ctx * kv_token_bytes) / bandwidth - flops.decode_step(n, ctx) / peak)
                        for _, p, n, ctx in eng["steps"] if p == 0 and n > 0)
    # The other two phases on the compute roof: steps with prefill (their FLOPs are the workload's minus those
    # of every decode-only step) and the decode-only steps below the batch threshold (the tail).
    decode_only = [st for st in eng["steps"] if st[1] == 0 and st[2] > 0]
    small = [st for st in decode_only if st[2] < s.decode_min_batch]
    prefill_s = sum(st[0] for st in eng["steps"] if st[1] > 0)
    prefill_flops = total - sum(flops.decode_step(n, ctx) for _, _, n, ctx in decode_only)
    small_s = sum(st[0] for st in small)
    small_flops = sum(flops.decode_step(n, ctx) for _, _, n, ctx in small)
    # The whole workload under the same model: every decode-only step pays its memory time on top.
    extra = sum(serial_step(n, ctx) - flops.decode_step(n, ctx) / peak
                for _, p, n, ctx in eng["steps"] if p == 0 and n > 0)
    out = {
        "workload_flops": total, "roofline_s": roof_s, "roofline_tok_s": r["workload"]["output_tokens"] / roof_s,
        "roofline_share": roof_s / eng["wall_s"],
        "decode_min_batch": s.decode_min_batch, "decode_steps": len(dec), "decode_tokens": dec_tokens,
        "decode_flops": dec_flops, "decode_s": dec_s,
        "decode_tok_s": dec_tokens / dec_s if dec_s else None,
        "decode_roofline_tok_s": dec_tokens / (dec_flops / peak) if dec else None,
        "decode_share": dec_flops / peak / dec_s if dec_s else None,
        "decode_share_with_memory_roof": dec_floor / dec_s if dec_s else None,
        "decode_share_bound_serial": dec_flops / peak / dec_serial if dec else None,
        "roofline_share_bound_serial": roof_s / (roof_s + extra),
        "decode_share_bound_overlap": dec_flops / peak / dec_floor if dec else None,
        "roofline_share_bound_overlap": roof_s / (roof_s + overlap_extra),
        "prefill_steps_s": prefill_s, "prefill_steps_share": prefill_flops / peak / prefill_s if prefill_s else None,
        "small_decode_steps": len(small), "small_decode_s": small_s,
        "small_decode_share": small_flops / peak / small_s if small_s else None,
        "weight_bytes": weight_bytes, "memory_floor_step_s": floor_step, "memory_floor_tok_s": 1 / floor_step,
        "single_stream_share": r["single_stream"]["decode_tok_s"] * floor_step,
    }
    # The same against each round's own floor, read right before and after it (run_single_stream_rounds): the
    # median of the rounds' shares. The verdict rests on this one where the run has it.
    if paired := [x for x in r["single_stream"].get("rounds", []) if "read_gbps" in x]:
        shares = [x["decode_tok_s"] * weight_bytes / (x["read_gbps"] * 1e9) for x in paired]  # in round order
        out["single_stream_paired_shares"] = shares
        out["single_stream_paired_share"] = sorted(shares)[len(shares) // 2]
    # The same share against each GEMM probe alone: the best probe (above) is the conservative roof, and the
    # spread between probes is how far this VM's rate moved during the run.
    probes = [run["peak_gflops"] for run in r.get("machine_rates_runs", [])]
    if len(probes) > 1:
        out["peak_probes_gflops"] = probes
        out["roofline_share_by_probe"] = [total / (g * 1e9) / eng["wall_s"] for g in probes]
    return out


def ratio(eng: dict, peer: dict | None) -> float | None:
    return eng["tok_s"] / peer["tok_s"] if peer and "tok_s" in peer else None


def build_tables(r: dict) -> list[tuple[str, list[str], list[tuple]]]:
    eng, a, rates = r["engine"], r["roofline"], r["machine_rates"]
    n = r["workload"]["num_requests"]
    packed = " (cpu_prepack_weights)" if eng.get("prepacked_bytes") else ""
    rows = [(f"infinilm-stream engine{packed}", eng["output_tokens"], f"{eng['wall_s']:.2f}", f"{eng['tok_s']:.1f}",
             "1.00×", "—")]
    for key, label in (("engine_default", "infinilm-stream engine, no packed copies (cpu_prepack_weights false)"),
                       ("engine_int8_kv", f"infinilm-stream engine{packed}, int8 KV cache (cache_bits 8)"),
                       ("engine_compact", "infinilm-stream engine, packed copies as exact compact panels "
                                          "(cpu_compact_weights; what the defaults pack for this model)"),
                       ("engine_huge_pages", f"infinilm-stream engine{packed}, KV cache and packed copies in huge "
                                             "pages (huge_pages true)")):
        d = r.get(key)
        if d is not None:
            same = f"{d['agreement']['identical_requests']}/{n} same, {100 * d['agreement']['common_prefix_share']:.0f}% prefix"
            rows.append((label, d["output_tokens"], f"{d['wall_s']:.2f}", f"{d['tok_s']:.1f}", f"{ratio(eng, d):.2f}×",
                         same))
    for key, label in (("hf_static", f"HF generate, static batches of {r['settings']['hf_batch_size']}"),
                       ("hf_continuous", f"HF continuous batching ({r['settings']['hf_cb_attn']})")):
        p = r.get(key)
        if p is None or "error" in p:
            rows.append((label, "—", "—", "—", "—", p["error"][:80] if p else "skipped"))
            continue
        same = f"{p['agreement']['identical_requests']}/{n} same, {100 * p['agreement']['common_prefix_share']:.0f}% prefix"
        rows.append((label, p["output_tokens"], f"{p['wall_s']:.2f}", f"{p['tok_s']:.1f}", f"{ratio(eng, p):.2f}×", same))
    throughput = ("Offline throughput, fp32", ["system", "output tokens", "wall s", "output tok/s", "ours ÷ this",
                                              "greedy tokens vs ours"], rows)

    def pct(x):
        return f"{100 * x:.1f}%" if x is not None else "n/a"

    ss, tt, mb = r["single_stream"], r["ttft"], a["decode_min_batch"]
    roof_rows = [(f"fp32 GEMM {shape}", f"{g:.1f} GFLOP/s") for shape, g in rates["gemm_gflops"].items()]
    roof_rows += [
        ("compute peak (best GEMM, before and after the runs)", f"{rates['peak_gflops']:.1f} GFLOP/s"),
        ("memory read / copy", f"{rates['read_gbps']:.1f} / {rates['copy_gbps']:.1f} GB/s"),
        ("workload FLOPs", f"{a['workload_flops'] / 1e12:.3f} TFLOP"),
        ("roofline time / engine time", f"{a['roofline_s']:.2f} s / {eng['wall_s']:.2f} s"),
        ("roofline tok/s / engine tok/s", f"{a['roofline_tok_s']:.1f} / {eng['tok_s']:.1f}"),
        ("engine share of roofline, whole workload", pct(a["roofline_share"])),
    ]
    if "peak_probes_gflops" in a:
        roof_rows.append(("GEMM probes before / after the runs, and the whole-workload share on each",
                          " / ".join(f"{g:.0f}" for g in a["peak_probes_gflops"]) + " GFLOP/s; "
                          + " / ".join(pct(x) for x in a["roofline_share_by_probe"])))
    roof_rows += [
        (f"decode-only steps at batch ≥ {mb}",
         f"{a['decode_steps']} steps, {a['decode_tokens']} tokens, {a['decode_s']:.2f} s"),
        (f"decode ≥ {mb}: engine / roofline tok/s",
         f"{a['decode_tok_s'] or 0:.1f} / {a['decode_roofline_tok_s'] or 0:.1f}" if a["decode_steps"] else "n/a"),
        (f"decode ≥ {mb}: share of compute roofline", pct(a["decode_share"])),
        (f"decode ≥ {mb}: share of compute+memory roofline", pct(a["decode_share_with_memory_roof"])),
        (f"decode ≥ {mb}: highest compute-roofline share with GEMMs and KV reads taking turns",
         pct(a.get("decode_share_bound_serial"))),
        ("whole workload: highest compute-roofline share, likewise", pct(a.get("roofline_share_bound_serial"))),
        (f"decode ≥ {mb}: highest compute-roofline share with every read hidden behind the arithmetic",
         pct(a.get("decode_share_bound_overlap"))),
        ("whole workload: highest compute-roofline share, likewise", pct(a.get("roofline_share_bound_overlap"))),
        ("steps with prefill: seconds, share of compute roofline",
         f"{a['prefill_steps_s']:.2f} s, {pct(a['prefill_steps_share'])}" if "prefill_steps_s" in a else "n/a"),
        (f"decode-only steps at batch < {mb}: steps, seconds, share of compute roofline",
         f"{a['small_decode_steps']}, {a['small_decode_s']:.2f} s, {pct(a['small_decode_share'])}"
         if "small_decode_s" in a else "n/a"),
        ("packed weight copies (cpu_prepack_weights)", f"{eng.get('prepacked_bytes', 0) / 2**20:.0f} MiB"),
        ("single stream: weights / floor step",
         f"{a['weight_bytes'] / 2**20:.0f} MiB / {1e3 * a['memory_floor_step_s']:.1f} ms"),
        ("single stream: engine / floor tok/s", f"{ss['decode_tok_s']:.1f} / {a['memory_floor_tok_s']:.1f}"),
        ("single stream: share of memory floor", pct(a["single_stream_share"])),
    ]
    if "single_stream_paired_share" in a:
        rounds = ss["rounds"]
        roof_rows.append(("single stream, each round against the read rate measured right before and after it: "
                          "read GB/s; share per round; median",
                          " / ".join(f"{x['read_gbps']:.1f}" for x in rounds) + " GB/s; "
                          + " / ".join(pct(x) for x in a["single_stream_paired_shares"]) + "; "
                          + pct(a["single_stream_paired_share"])))
    if "layer_by_layer" in ss:
        lbl = ss["layer_by_layer"]["decode_tok_s"]
        roof_rows.append(("single stream, layer by layer (decode_layers off): tok/s, engine ÷ this",
                          f"{lbl:.1f}, {ss['decode_tok_s'] / lbl:.2f}×"))
    if (hp := r.get("engine_huge_pages")) and "single_stream" in hp:
        tok_s = hp["single_stream"]["decode_tok_s"]
        roof_rows.append(("single stream in huge pages (huge_pages true): tok/s, ÷ the engine's, share of the floor",
                          f"{tok_s:.1f}, {tok_s / ss['decode_tok_s']:.2f}×, {pct(tok_s / a['memory_floor_tok_s'])}"))
    if (c := r.get("engine_compact")) and "single_stream" in c:
        tok_s, streamed = c["single_stream"]["decode_tok_s"], c["decode_weight_bytes"]
        floor = r["machine_rates"]["read_gbps"] * 1e9 / streamed
        roof_rows += [
            ("compact panels: packed copies; weight bytes a decode step streams",
             f"{c['prepacked_bytes'] / 2**20:.0f} MiB; {streamed / 2**20:.0f} MiB"),
            ("compact panels, single stream: tok/s, ÷ the fp32-panel engine's, share of the fp32 weights' floor",
             f"{tok_s:.1f}, {tok_s / ss['decode_tok_s']:.2f}×, {pct(tok_s / a['memory_floor_tok_s'])}"),
            ("compact panels, single stream: floor of the bytes it streams, share of it",
             f"{floor:.1f} tok/s, {pct(tok_s / floor)}"),
        ]
    roof_rows += [
        (f"TTFT, {tt['prefix_tokens']}-token prefix: cold / cached (median)",
         f"{1e3 * tt['cold_median_s']:.0f} ms / {1e3 * tt['cached_median_s']:.0f} ms"),
        ("TTFT speed-up from the prefix cache", f"{tt['speedup']:.1f}×"),
    ]
    roof = ("Roofline and latency", ["measure", "value"], roof_rows)

    def target(name, goal, value, threshold, fmt, share=False):
        if value is None:
            return (name, goal, "not measured", "—")
        if share and value > 1:
            # A roof the engine beats was measured at a slower moment than the engine ran (the VM's rates
            # move): no verdict either way.
            return (name, goal, fmt(value), "no verdict: above its roof")
        return (name, goal, fmt(value), "yes" if value >= threshold else "no")

    def x(v):
        return f"{v:.2f}×"

    targets = ("Targets from the tracker", ["target", "goal", "reached", "met"], [
        target("throughput vs HF static batches", "≥ 4×", ratio(eng, r.get("hf_static")), 4, x),
        target("throughput vs HF continuous batching", "≥ 6×", ratio(eng, r.get("hf_continuous")), 6, x),
        target("share of compute roofline, whole workload", "≥ 65%", a["roofline_share"], 0.65, pct, share=True),
        target(f"share of compute roofline, decode at batch ≥ {mb}", "≥ 70%", a["decode_share"], 0.70, pct,
               share=True),
        target("single-stream decode vs memory floor" + (", each round's own floor (median)"
                                                           if "single_stream_paired_share" in a else ""),
               "≥ 80%", a.get("single_stream_paired_share", a["single_stream_share"]), 0.80, pct, share=True),
        target("cached TTFT speed-up", "≥ 5×", tt["speedup"], 5, x),
    ])
    return [throughput, roof, targets]


def write_docs(r: dict, tables) -> None:
    m, one = r["machine"], r["one_time_s"]
    body = "\n\n".join([
        START, "## Offline throughput and CPU roofline (fp32, SmolLM2-135M-Instruct)",
        f"Measured {m['date']} on {m['cpu']} ({m['cpu_count']} CPUs, {m['torch_threads']} torch threads, "
        f"load average at start {m['load_average_at_start'][0]}), torch {m['torch']}, transformers {m['transformers']}. "
        "Reproduce from the repository root with:",
        f"    {r['command']}",
        *(markdown_table(*t) for t in tables),
        "How it is measured: "
        f"{r['workload']['num_requests']} requests cut at distinct random offsets of the GPL-3 text (seed {r['seed']}), "
        f"prompts of {r['settings']['prompt_lens'][0]}–{r['settings']['prompt_lens'][1]} tokens, "
        f"{r['settings']['output_lens'][0]}–{r['settings']['output_lens'][1]} greedy output tokens each, EOS ignored, "
        "all submitted at once; every system runs in one process with the same threads, after a warm-up. "
        "The engine's figures, ratios and roofline shares are for its `cpu_prepack_weights` option (a second, "
        "packed copy of the linear weights, read by batches of up to 256 rows: by the panel kernel on AVX2 and AVX-512 CPUs, "
        "else by oneDNN); the rows after it are the same workload without the copy (`cpu_prepack_weights: false`, "
        "the engine's defaults until 2026-12-05), "
        "with the copy over an int8 KV cache (`cache_bits: 8`, rows quantized per token and KV head: not fp32, so "
        "not the figure the ratios and roofline shares use), and with the copy as exact compact panels "
        "(`cpu_compact_weights`, on by default with the copy: SmolLM2's fp32 weights are exactly the 4-bit and "
        "8-bit codes of its GGUF file times fp16 scales, so the panels hold the codes and the kernel rebuilds the "
        "same values; the arithmetic and every token are the same, only fewer weight bytes are read; kept out of "
        "the headline, which stays the engine that stores fp32, as a model without such weights would run; the "
        "defaults, `cpu_prepack_weights: auto` since 2026-12-05, keep packed copies only where they are compact, "
        "which for SmolLM2 is every weight, so this row), and with the KV cache and packed copies in transparent "
        f"huge pages (`huge_pages: true`, engine/hugepages.py). {pages_note(r)} The memory read rate is the better "
        "of a sum over torch's 4 KiB pages and over huge pages. "
        "HF static batches are left-padded, run to the batch's longest request and count only each request's "
        "requested tokens; `min_new_tokens = max_new_tokens` stops EOS from ending a row (it masks EOS, where the "
        "engine's `ignore_eos` only ignores it). HF continuous batching gets `eos_token_id=-1` per request, which "
        "drops EOS from its stop set, the engine's token budget and sequence limit, and room for the whole workload. "
        "FLOPs: 2 × non-embedding parameters per computed token, the LM head only for sampled rows, and "
        "4 × layers × heads × head_dim per attended token; the roof is the best fp32 GEMM rate measured before "
        "and after the runs (a 2-core VM's rates move between runs by up to a third), each GEMM timed with "
        "torch.mm and with oneDNN's linear (runs before 2026-12-05 16:40 UTC timed torch.mm alone). "
        "Whole-workload shares use wall time; decode shares use the engine's own step times. "
        "The single-stream floor is the weight bytes over the measured read bandwidth, per token; single-stream "
        f"decode is the median of {r['settings'].get('single_rounds', 1)} runs of {r['settings']['single_output']} "
        "tokens, alternated with runs that have the one-call decoder (decode_layers, which runs every layer of a "
        "decode-only step in one C++ call) turned off. Where the run has them (from 2026-12-05 16:40 UTC), the "
        "single-stream verdict is the median over rounds of each round's share of its own floor, from the better "
        "of the read rates measured right before and right after it: this VM's read rate moves by up to 2× within "
        "seconds, so a floor read at another moment can sit on either side of the engine. A share above 100% "
        "gets no verdict: its roof was measured at a slower moment than the engine ran.",
        f"One-time costs, outside every number above: C++ kernels built or loaded in {one['kernel_build_or_load']:.1f} s, "
        f"engine start {one['engine_start']:.1f} s, warm-up {one['engine_warmup']:.1f} s.",
        END,
    ])
    text = DOCS.read_text() if DOCS.exists() else (
        "# CPU engine\n\nGenerated sections: each sits between its own markers and is rewritten by its script; edit "
        "the scripts, not these sections. Raw numbers are in `bench/results/`.\n")
    if START in text and END in text:
        text = text[:text.index(START)] + body + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + body + "\n"
    DOCS.write_text(text)


# ---- main ------------------------------------------------------------------------------------


def invocation() -> str:
    python = os.path.relpath(sys.executable) if sys.executable.startswith(str(REPO)) else sys.executable
    target = ["-m", "bench.throughput"] if __spec__ is not None else [os.path.relpath(sys.argv[0])]
    return shlex.join([python, *target, *sys.argv[1:]])


def report_saved_run(path: Path, publish: bool) -> None:
    """Recompute the analysis of a saved full run from its raw measurements; print it, and publish it if asked."""
    try:
        r = json.loads(path.read_text())
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in r["settings"].items()
                  if k in Settings.__dataclass_fields__}
        s = Settings(**fields)
        weight_bytes = r["roofline"]["weight_bytes"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"{path}: not a saved bench.throughput run ({type(exc).__name__}: {exc})") from None
    mc = ModelConfig.from_folder(resolve_model("smollm2"))
    r["roofline"] = analyse(r, roofline.FlopModel.from_config(mc), weight_bytes, roofline.kv_bytes_per_token(mc), s)
    tables = build_tables(r)
    for t in tables:
        print_table(*t)
    console.print(f"re-analysed {path} (measured {r['machine']['date']}, {r.get('command', '?')})")
    if publish:
        path.write_text(json.dumps(r, indent=1) + "\n")
        write_docs(r, tables)
        console.print(f"wrote {path.relative_to(REPO)} and {DOCS.relative_to(REPO)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small workload to check the script end to end")
    ap.add_argument("--profile", action="store_true", help="only the engine's run, under torch.profiler")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--hf-cb-attn", default="sdpa", help="attention of HF continuous batching: sdpa or paged|eager")
    ap.add_argument("--skip-hf", action="store_true", help="measure the engine only")
    ap.add_argument("--no-prepack", action="store_true",
                    help="measure the engine without cpu_prepack_weights only (by default the table has both)")
    ap.add_argument("--report", nargs="?", type=Path, const=RESULTS / "throughput.json", metavar="JSON",
                    help="measure nothing: re-analyse a saved run (default bench/results/throughput.json) and print "
                         "its tables; the default run's JSON and docs section are rewritten with them, e.g. after a "
                         "change to the analysis, any other file is only printed")
    args = ap.parse_args()
    if args.report is not None:
        report_saved_run(args.report, publish=args.report.resolve() == (RESULTS / "throughput.json").resolve())
        return
    s = QUICK if args.quick else Settings()
    command = invocation()
    console.print(f"[bold]$ {command}[/bold]")
    isa = isa_path()
    torch.set_num_threads(args.threads)
    # Partial or non-default runs keep their own JSON and leave docs/perf/cpu-engine.md alone.
    suffix = "-quick" if args.quick else ""
    suffix += "-no-prepack" if args.no_prepack else ""
    suffix += "-engine-only" if args.skip_hf else ""
    from engine.kernels.cpu_build import host_isa

    suffix += f"-{isa}" if isa != host_isa() else ""  # a capped ISA (INFINILM_CPU_ISA) is not the host's figure
    RESULTS.mkdir(parents=True, exist_ok=True)

    path = resolve_model("smollm2")
    r: dict = {"command": command, "seed": args.seed, "machine": roofline.describe_machine(), "isa": isa,
               "settings": {**s.__dict__, "threads": args.threads, "hf_cb_attn": args.hf_cb_attn}}

    # One-time costs, timed apart: the C++ kernels (built once per machine, then loaded from disk), the model.
    from engine.kernels.cpu_build import kernels_available

    t0 = time.perf_counter()
    kernels = kernels_available()
    t1 = time.perf_counter()
    kv_tokens = s.num_requests * (s.prompt_lens[1] + s.output_lens[1] + 16)
    mc = ModelConfig.from_folder(path)
    llm = LLM(model=str(path), dtype="float32", max_num_seqs=64, max_num_batched_tokens=2048, num_threads=args.threads,
              kv_cache_memory_bytes=kv_tokens * roofline.kv_bytes_per_token(mc), cpu_prepack_weights=not args.no_prepack,
              cpu_compact_weights=False)
    t2 = time.perf_counter()
    text_ids = llm.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    t3 = time.perf_counter()
    llm.generate([text_ids[:16], text_ids[16:40]], [greedy(8), greedy(4)])  # warm-up: prefill and decode paths
    t4 = time.perf_counter()
    w = build_workload(text_ids, s, args.seed)
    r["one_time_s"] = {"kernel_build_or_load": t1 - t0, "kernels_available": kernels, "engine_start": t2 - t1,
                       "engine_warmup": t4 - t3}
    r["workload"] = {"num_requests": len(w.prompts), "prompt_tokens": sum(map(len, w.prompts)),
                     "output_tokens": w.num_output_tokens, "prompt_lens": list(map(len, w.prompts)),
                     "output_lens": w.output_lens}

    if args.profile:
        profile_engine(llm, w, RESULTS / f"throughput-profile{suffix}.txt")
        return

    with progress_bar("measuring GEMM and memory rates", len(roofline.GEMM_SHAPES) + 1) as advance:
        r["machine_rates"] = roofline.measure_machine(s.machine_repeats, advance).to_dict()

    run = run_engine(llm, w)
    r["engine"] = {"output_tokens": sum(map(len, run.outputs)), "wall_s": run.wall_s,
                   "tok_s": sum(map(len, run.outputs)) / run.wall_s, "num_cached_tokens": run.num_cached_tokens,
                   "num_preemptions": run.num_preemptions, "num_steps": len(run.steps), "steps": run.steps}
    single_at = len(text_ids) // 2
    read_probe = roofline.ReadProbe()
    r["single_stream"] = run_single_stream_rounds(llm, text_ids[single_at:single_at + s.single_prompt],
                                                  s.single_output, s.single_rounds, read_probe)
    del read_probe
    r["ttft"] = run_ttft(llm, text_ids, s, args.seed)
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    r["engine"]["prepacked_bytes"] = llm.engine.prepacked_bytes
    r["engine"]["huge_pages"] = llm.engine.config.huge_pages
    del llm
    gc.collect()
    if not args.no_prepack:
        budget = kv_tokens * roofline.kv_bytes_per_token(mc)
        # The same workload, in the same process, without packed weight copies (the defaults until 2026-12-05), with the
        # packed copies over an int8 KV cache (a quarter of the KV bytes to read per step), and with the packed
        # copies as exact compact panels (the same fp32 values from 4-bit and 8-bit codes: bitwise the same
        # tokens, a sixth of the weight bytes to stream; its single stream is measured too).
        for key, options in (("engine_default", {"cpu_prepack_weights": False}),
                             ("engine_int8_kv", {"cpu_prepack_weights": True, "cpu_compact_weights": False,
                                                 "cache_bits": 8}),
                             ("engine_compact", {"cpu_prepack_weights": True, "cpu_compact_weights": True}),
                             ("engine_huge_pages", {"cpu_prepack_weights": True, "cpu_compact_weights": False,
                                                    "huge_pages": True})):
            llm = LLM(model=str(path), dtype="float32", max_num_seqs=64, max_num_batched_tokens=2048,
                      num_threads=args.threads, kv_cache_memory_bytes=budget, **options)
            llm.generate([text_ids[:16], text_ids[16:40]], [greedy(8), greedy(4)])
            other = run_engine(llm, w)
            r[key] = {"output_tokens": sum(map(len, other.outputs)), "wall_s": other.wall_s,
                      "tok_s": sum(map(len, other.outputs)) / other.wall_s,
                      "agreement": agreement(run.outputs, other.outputs)}
            if key == "engine_huge_pages":
                r[key]["single_stream"] = run_single_stream_rounds(
                    llm, text_ids[single_at:single_at + s.single_prompt], s.single_output, s.single_rounds)
            if key == "engine_compact":
                r[key]["prepacked_bytes"] = llm.engine.prepacked_bytes
                r[key]["decode_weight_bytes"] = decode_weight_bytes(llm.engine.model)
                r[key]["single_stream"] = run_single_stream_rounds(
                    llm, text_ids[single_at:single_at + s.single_prompt], s.single_output, s.single_rounds)
            del llm
            gc.collect()
    # The roof again after the runs: a machine that was slow at the start must not lower it.
    with progress_bar("measuring GEMM and memory rates again", len(roofline.GEMM_SHAPES) + 1) as advance:
        again = roofline.measure_machine(s.machine_repeats, advance).to_dict()
    r["machine_rates_runs"] = [r["machine_rates"], again]
    r["machine_rates"] = roofline.best_rates(r["machine_rates_runs"])

    if not args.skip_hf:
        model = load_hf(path)
        try:
            outs, wall, computed = run_hf_static(model, w, s.hf_batch_size, mc.eos_token_ids[0])
            r["hf_static"] = {"output_tokens": w.num_output_tokens, "tokens_generated_incl_padding": computed,
                              "wall_s": wall, "tok_s": w.num_output_tokens / wall,
                              "agreement": agreement(run.outputs, outs)}
        except Exception as exc:  # report a peer that cannot run instead of losing the whole benchmark
            r["hf_static"] = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            outs, wall = run_hf_continuous(model, w, mc.eos_token_ids[0], args.hf_cb_attn, 2048, 64)
            r["hf_continuous"] = {"output_tokens": sum(map(len, outs)), "wall_s": wall,
                                  "tok_s": sum(map(len, outs)) / wall, "agreement": agreement(run.outputs, outs)}
        except Exception as exc:
            r["hf_continuous"] = {"error": f"{type(exc).__name__}: {exc}"}

    r["roofline"] = analyse(r, roofline.FlopModel.from_config(mc), weight_bytes, roofline.kv_bytes_per_token(mc), s)
    tables = build_tables(r)
    for t in tables:
        print_table(*t)
    console.print(f"one-time costs: kernels {r['one_time_s']['kernel_build_or_load']:.2f} s, engine start "
                  f"{r['one_time_s']['engine_start']:.2f} s, warm-up {r['one_time_s']['engine_warmup']:.2f} s; "
                  f"prefix-cache hits in the workload: {sum(run.num_cached_tokens)} tokens; "
                  f"preemptions: {run.num_preemptions}")
    out = RESULTS / f"throughput{suffix}.json"
    out.write_text(json.dumps(r, indent=1) + "\n")
    console.print(f"wrote {out.relative_to(REPO)}")
    if not suffix:
        write_docs(r, tables)
        console.print(f"wrote {DOCS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
