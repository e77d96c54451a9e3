"""Where a CPU decode step's time goes: the one-call decoder against its parts, each timed alone.

    .venv/bin/python -m bench.kernels.decode_breakdown
    .venv/bin/python -m bench.kernels.decode_breakdown --batches 16 28 48 64 --context 300 --rounds 9

One engine with bench.throughput's headline options (SmolLM2-135M-Instruct, fp32, packed fp32 panels, the default
huge pages). For each batch size B: B requests of `--context` prompt tokens, cut from bench.throughput's text, run
until the first decode-only step, whose call of the one-call decoder (engine/models/csrc/decode_layers.cpp) is
kept with its exact arguments. Then these arms alternate, `--rounds` times, in one process:

- step: that decode_layers call again (every layer, the engine's split choice, the final norm; not the LM head);
- linears: the step's 120 panel products (30 layers' qkv, o_proj, gate_up, down) on B random rows, each layer's
  own weights, which stream from memory as in the step;
- linears, one layer's weights: the same 120 products on layer 0's four weights, which stay in the caches: the
  panel kernel's arithmetic with no weight stream;
- attention: the 30 layers' paged decode attention over the kept step's block tables and lengths;
- LM head: the tied head on B rows;
- and, each round, the fp32 GEMM rate (2048^3, bench.roofline) and the read rate of that moment.

The table gives each arm's median and its rate, the linears' two floors (FLOPs at the GEMM rate, weight bytes at
the read rate: with the weight stream hidden behind the arithmetic the linears take the larger, taking turns the
sum) and what the step spends outside the linears and attention. Writes bench/results/kernels/decode_breakdown.json and
its section of docs/perf/kernels.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench import roofline
from bench.report import PERF, publish_table, run_info, write_json
from bench.throughput import TEXT, greedy, progress_bar
from engine import LLM
from engine.kernels.cpu_build import cpu_kernels
from engine.model_registry import resolve_model
from engine.models.config import ModelConfig

# decode_layers' arguments that belong to one step: x, slot_mapping, block_tables, seq_lens, positions.
STEP_ARGS = (0, 4, 5, 6, 7)
MAX_BATCHED_TOKENS = 2048
ARMS = ("step", "linears", "linears_cached", "attention", "lm_head")


def output_tokens(prompt_tokens: int, token_budget: int) -> int:
    """Tokens each request asks for: enough that every request still runs when the last prompt's prefill is
    done (the first requests decode during the other prompts' prefill steps)."""
    return 2 + -(-prompt_tokens // token_budget)


def capture_decode_call(llm: LLM, prompts: list[list[int]], tag: str) -> tuple[tuple, torch.Tensor]:
    """The arguments of the first decode_layers call in which every request of `prompts` decodes, and what that
    call returned; the requests are then aborted. Raises where the engine never calls decode_layers (it
    runs on the panels, AVX2 or AVX-512). The weights, KV caches and model constants are the engine's own; the step's own
    tensors (its rows, slots, block tables, lengths, positions) are copies, as decode_layers updates hidden-state
    rows in place and the engine may reuse its metadata buffers."""
    ops, engine = cpu_kernels(), llm.engine
    real, kept = ops.decode_layers, []

    def keep(*args):
        first = not kept and args[0].shape[0] == len(prompts)
        # The step's rows and its metadata (slots, block tables, lengths, positions) may live in buffers that
        # later steps reuse; the weights, caches and model constants are the engine's own.
        saved = [a.clone() if i in STEP_ARGS else a for i, a in enumerate(args)] if first else None
        out = real(*args)
        if first:
            kept.append((tuple(saved), out.clone()))
        return out

    params = greedy(output_tokens(sum(map(len, prompts)), engine.config.max_num_batched_tokens))
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    ops.decode_layers = keep
    try:
        while engine.has_unfinished_requests() and not kept:
            engine.step()
    finally:
        ops.decode_layers = real
        # Stop here: further steps would write K/V into blocks that finished requests gave back, which the
        # kept block tables still point at.
        for i in range(len(prompts)):
            engine.abort_request(f"{tag}-{i}")
    while engine.has_unfinished_requests():  # hands out the aborts; nothing is scheduled
        engine.step()
    if not kept:
        raise SystemExit("the engine ran no full-batch decode step through decode_layers (it needs the panels: AVX2 or AVX-512)")
    return kept[0]


def arms(model, args: tuple, rows: int) -> dict[str, Callable[[], object]]:
    """The timed calls, keyed as ARMS."""
    ops, cfg = cpu_kernels(), model.config
    step_x = args[0]
    kv_caches, tables, lens = args[2], args[5], args[6]
    scale = model.layers[0].self_attn.backend.scale
    linears = model.decoder_linears()
    cached = list(model.layer_linears(model.layers[0])) * len(model.layers)
    g = torch.Generator().manual_seed(rows)
    xs = {n: torch.randn(rows, n, generator=g) for n in {m.in_features for m in linears}}
    q = torch.randn(rows, cfg.num_heads, cfg.head_dim, generator=g)
    hidden = torch.randn(rows, cfg.hidden_size, generator=g)

    def products(ms):
        return lambda: [ops.panel_linear(xs[m.in_features], m.packed, m.out_features, None) for m in ms]

    return {
        # x is updated in place when it holds hidden states (not token ids): each call gets the kept values.
        "step": lambda: ops.decode_layers(step_x.clone() if step_x.is_floating_point() else step_x, *args[1:]),
        "linears": products(linears),
        "linears_cached": products(cached),
        "attention": lambda: [ops.paged_decode_attention(q, kv, tables, lens, scale) for kv in kv_caches],
        "lm_head": lambda: model.compute_logits(hidden),  # measure() runs it in inference mode, as the engine
    }


def measure(calls: dict[str, Callable[[], object]], rounds: int, gemm: Callable[[], float],
            read: Callable[[], float], advance=lambda: None) -> dict:
    """Alternating rounds of every arm (the order turned each round), with the GEMM and read rates of each round."""
    with torch.inference_mode():  # as the engine runs: linear() takes its fast paths only without autograd
        return _measure(calls, rounds, gemm, read, advance)


def _measure(calls, rounds, gemm, read, advance) -> dict:
    for fn in calls.values():
        fn()  # first calls pay allocations
    times: dict[str, list[float]] = {k: [] for k in calls}
    rates: dict[str, list[float]] = {"gemm_gflops": [], "read_gbps": []}
    names = list(calls)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - t0)
        rates["gemm_gflops"].append(gemm())
        rates["read_gbps"].append(read())
        advance()
    return {**times, **rates}


def row(batch: dict, layer_flops: int, weight_bytes: int, kv_row_bytes: int) -> tuple:
    """One table row from a batch's measurement: medians, rates and floors."""
    med = {k: statistics.median(batch[k]) for k in (*ARMS, "gemm_gflops", "read_gbps")}
    flops = layer_flops * batch["rows"]
    kv_bytes = batch["context_tokens"] * kv_row_bytes
    compute_floor = flops / (med["gemm_gflops"] * 1e9)
    read_floor = weight_bytes / (med["read_gbps"] * 1e9)
    rest = med["step"] - med["linears"] - med["attention"]
    return (batch["rows"], batch["context_tokens"], f"{med['step'] * 1e3:.1f}",
            f"{med['linears'] * 1e3:.1f} ({flops / med['linears'] / 1e9:.0f})",
            f"{med['linears_cached'] * 1e3:.1f} ({flops / med['linears_cached'] / 1e9:.0f})",
            f"{compute_floor * 1e3:.1f} / {read_floor * 1e3:.1f}",
            f"{med['attention'] * 1e3:.1f} ({kv_bytes / med['attention'] / 1e9:.1f})",
            f"{rest * 1e3:.1f}", f"{med['lm_head'] * 1e3:.1f}",
            f"{med['gemm_gflops']:.0f} / {med['read_gbps']:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 28, 48, 64], help="decode rows a step (1-64)")
    ap.add_argument("--context", type=int, default=300, help="prompt tokens a request (default 300)")
    ap.add_argument("--rounds", type=int, default=9, help="alternations of the arms (default 9)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    args = ap.parse_args()
    if args.rounds < 1 or args.context < 1 or any(not 1 <= b <= 64 for b in args.batches):
        ap.error("--rounds and --context must be at least 1, --batches between 1 and 64")
    if cpu_kernels() is None or not cpu_kernels().panel_gemm_available():
        raise SystemExit("the one-call decoder needs AVX2 or AVX-512 and the CPU extension, which this machine lacks")
    torch.set_num_threads(args.threads)
    path = resolve_model("smollm2")
    mc = ModelConfig.from_folder(path)
    most = max(args.batches)
    kv_tokens = most * (args.context + output_tokens(most * args.context, MAX_BATCHED_TOKENS) + 32)
    llm = LLM(model=str(path), dtype="float32", max_num_seqs=64, max_num_batched_tokens=MAX_BATCHED_TOKENS,
              num_threads=args.threads, cpu_prepack_weights=True, cpu_compact_weights=False,
              kv_cache_memory_bytes=kv_tokens * roofline.kv_bytes_per_token(mc))
    model = llm.engine.model
    text = llm.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    if len(text) < args.context + max(args.batches):
        ap.error(f"--context {args.context} is longer than the text allows ({len(text)} tokens)")
    linears = model.decoder_linears()
    layer_flops = sum(2 * m.in_features * m.out_features for m in linears)
    weight_bytes = sum(m.packed.numel() * m.packed.element_size() for m in linears)
    kv_row_bytes = roofline.kv_bytes_per_token(mc)
    probe = roofline.ReadProbe()
    data = {**run_info("bench.kernels.decode_breakdown", args.threads), "context": args.context,
            "split_rows": model.fused_decoder.split_rows if model.fused_decoder else None, "layer_flops_per_row": layer_flops, "weight_bytes": weight_bytes,
            "kv_row_bytes": kv_row_bytes, "batches": []}
    stride = (len(text) - args.context) // max(args.batches)
    with progress_bar("decode step and its parts", len(args.batches) * args.rounds) as advance:
        for b in args.batches:
            llm.engine.block_manager.reset_prefix_cache()
            prompts = [text[i * stride:i * stride + args.context] for i in range(b)]
            kept, _ = capture_decode_call(llm, prompts, f"b{b}")
            result = measure(arms(model, kept, b), args.rounds,
                             lambda: roofline.measure_gemm(2048, 2048, 2048, 2), lambda: probe(2), advance)
            data["batches"].append({"rows": b, "context_tokens": int(kept[6].sum()), **result})
    write_json("kernels/decode_breakdown.json", data)

    headers = ["rows", "context tokens", "step ms", "linears ms (GFLOP/s)", "linears, one layer's weights ms (GFLOP/s)",
               "linears' floors: FLOPs / weight bytes ms", "attention ms (KV GB/s)", "rest of the step ms",
               "LM head ms", "GEMM GFLOP/s / read GB/s"]
    table = [row(b, layer_flops, weight_bytes, kv_row_bytes) for b in data["batches"]]
    publish_table(
        "decode_breakdown", "Where a decode step's time goes (SmolLM2-135M, fp32 panels, CPU)", data,
        f"requests of {args.context} prompt tokens, the first decode-only step's decode_layers call (the engine's "
        f"split from {data['split_rows']} rows a thread) against its parts timed alone, alternating {args.rounds} "
        f"rounds; medians. Linears: the 120 panel products on each layer's own weights "
        f"({weight_bytes / 2**20:.0f} MiB, streamed from memory) and on layer 0's weights repeated (in the caches); "
        "their floors are the FLOPs at the round's GEMM rate and the weight bytes at its read rate. Rest of the "
        "step: the step less the linears and the attention (norms, RoPE, K/V writes, activations, and whatever the "
        "two parts lose or gain by running together).",
        "A decode step against its parts", headers, table, docs=PERF / "kernels.md")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"done in {time.perf_counter() - t0:.0f} s")
