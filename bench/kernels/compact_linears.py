"""Every linear of one decode step of SmolLM2-135M on its compact panels: this tree's panel kernel against an
earlier commit's.

    .venv/bin/python -m bench.kernels.compact_linears
    .venv/bin/python -m bench.kernels.compact_linears --base b787c43 --rows 1 2 4 --rounds 40

SmolLM2's fp32 weights are exactly 4-bit and 8-bit codes times fp16 scales, so the engine's defaults keep them as
compact panels (cpu_prepack_weights: auto), which calls of 1-12 rows read straight from the codes (panel_gemm.cpp's
fused runs) and calls of 13-256 rows rebuild panel by panel into a scratch first. One pass is what a decode step of `rows` tokens asks of the kernel: the 30 layers' qkv, o_proj,
gate_up and down products and the tied LM head, on the engine's own packed weights. Two arms, both calling the
kernel directly: this tree's panel_linear and the one built from engine/models/csrc/panel_gemm.cpp at git revision
BASE, reading the same packed weights. They alternate, the order swapped every round; their outputs must be
bitwise equal; the verdict is the median of the rounds' ratios, each against the other arm's pass beside it.
The default base is the commit before the fused runs' width was chosen for an even share over the threads. Writes
bench/results/kernels/compact_linears.json and its section of docs/perf/kernels.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench.kernels.git_kernel import build_at_revision
from bench.report import PERF, publish_table, run_info, write_json
from bench.throughput import progress_bar
from engine import LLM
from engine.kernels.cpu_build import cpu_kernels
from engine.model_registry import resolve_model

DEFAULT_BASE = "b787c43"  # fused compact runs always 4 panels wide at one row, 2 at 2-4 rows
KERNEL = "engine/models/csrc/panel_gemm.cpp"


def step_linears(model) -> list[tuple[torch.Tensor, int, int]]:
    """(packed weight, in_features, out_features) of every linear a decode step runs, the tied LM head last."""
    out = [(m.packed, m.in_features, m.out_features) for m in model.decoder_linears()]
    head = model.embed_tokens.packed_head
    if head is not None:
        out.append((head, model.config.hidden_size, model.config.vocab_size))
    return out


def one_pass(kernel, linears, xs: dict[int, torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
    start = time.perf_counter()
    outs = [kernel.panel_linear(xs[k], packed, n, None) for packed, k, n in linears]
    return time.perf_counter() - start, outs


def compare(this, base, linears, rows: int, rounds: int, advance=lambda: None) -> dict:
    """Alternating passes of the two kernels at `rows` rows; raises if their outputs differ."""
    g = torch.Generator().manual_seed(rows)
    xs = {k: torch.randn(rows, k, generator=g) for k in {k for _, k, _ in linears}}
    times: dict[str, list[float]] = {"this": [], "base": []}
    for r in range(rounds):
        outs = {}
        for arm in (("base", "this") if r % 2 == 0 else ("this", "base")):
            seconds, outs[arm] = one_pass(this if arm == "this" else base, linears, xs)
            times[arm].append(seconds)
        if not all(torch.equal(a, b) for a, b in zip(outs["this"], outs["base"], strict=True)):
            raise SystemExit(f"{rows} rows: the two kernels' outputs differ")
        advance()
    return {"rows": rows, **times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=DEFAULT_BASE, help=f"git revision of the baseline kernel (default {DEFAULT_BASE})")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4], help="rows a pass (tokens in the step), 1-256")
    ap.add_argument("--rounds", type=int, default=40, help="alternations of the two kernels (default 40)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    args = ap.parse_args()
    if args.rounds < 1 or any(not 1 <= r <= 256 for r in args.rows):
        ap.error("--rounds must be at least 1 and --rows between 1 and 256 (the panel kernel's range)")
    if cpu_kernels() is None or not cpu_kernels().panel_gemm_available():
        raise SystemExit("the panel kernel needs AVX2 or AVX-512 and the CPU extension, which this machine lacks")
    torch.set_num_threads(args.threads)
    llm = LLM(model=str(resolve_model("smollm2")), dtype="float32", num_threads=args.threads,
              kv_cache_memory_bytes=1 << 26)
    linears = step_linears(llm.engine.model)
    if not all(p is not None and p.dtype == torch.uint8 for p, _, _ in linears):
        raise SystemExit("the model's packed weights are not all compact panels here; nothing to compare")
    base = build_at_revision(args.base, [KERNEL], ["panel_linear"])
    data = {**run_info("bench.kernels.compact_linears", args.threads), "base": args.base,
            "weight_bytes": sum(p.numel() for p, _, _ in linears), "passes": []}
    with progress_bar("compact linears, this tree and base", len(args.rows) * args.rounds) as advance:
        for rows in args.rows:
            data["passes"].append(compare(cpu_kernels(), base, linears, rows, args.rounds, advance))
    write_json("kernels/compact_linears.json", data)

    headers = ["rows", "base ms", "this tree ms", "this tree ÷ base speed", "rounds' ratios, min-max"]
    table = []
    for p in data["passes"]:
        ratios = [b / t for b, t in zip(p["base"], p["this"], strict=True)]
        table.append((p["rows"], f"{statistics.median(p['base']) * 1e3:.2f}", f"{statistics.median(p['this']) * 1e3:.2f}",
                      f"{statistics.median(ratios):.3f}×", f"{min(ratios):.2f}-{max(ratios):.2f}"))
    publish_table(
        "compact_linears", "Compact panels, every linear of a decode step (SmolLM2-135M, CPU)", data,
        f"the 121 products of one decode step (30 layers' qkv, o_proj, gate_up and down, and the tied LM head; "
        f"{data['weight_bytes'] / 2**20:.0f} MiB of compact panels) at each row count, this tree's panel kernel "
        f"against the one at {args.base}, alternating {args.rounds} rounds; medians of the passes, and the median of "
        "the rounds' ratios. Outputs bitwise equal in every round.",
        "One decode step's linears on compact panels", headers, table, docs=PERF / "kernels.md")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"done in {time.perf_counter() - t0:.0f} s")
