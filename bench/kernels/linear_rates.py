"""GFLOP/s of SmolLM2-135M's linear layers at decode- and prefill-sized row counts, per CPU path.

    .venv/bin/python -m bench.kernels.linear_rates                 # rows 1, 8, 16, 32, 48, 64, 128, 256, 512
    .venv/bin/python -m bench.kernels.linear_rates --rows 32 64
    .venv/bin/python -m bench.kernels.linear_rates --rows 64 128 256 400 1024 --shapes qkv o_proj gate_up down
                                                                  # a prefill's products (no LM head)

For each row count and weight shape (random weights: only the shapes matter), the
median time of: the engine's skinny kernel (1-8 rows), MKL (`torch.mm`), oneDNN on
the plain weight, oneDNN on its packed copy (what `cpu_prepack_weights` keeps on CPUs
without AVX2), and the panel kernel on its packed copy (what it keeps on AVX2 and AVX-512
CPUs, up to 256 rows; engine/models/linear.py), and, from 64 rows, the engine's bf16 prefill path
(`cpu_prefill_dtype: bfloat16`: `linear` on the weight's bf16 copy in a prompt step, the conversion of
the rows to bf16 and of the product back to fp32 included). Each weight is called repeatedly, so
it sits in cache: bench.kernels.panel_gemm measures the paths with a whole model's weights
streamed from memory, as in a decode step. The last column is the roofline's own reference, a
2048-row product, so the table shows how far decode-shaped products fall short of
the roof that bench.throughput divides by. Writes bench/results/kernels/linear_rates.json
and its section of docs/perf/kernels.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from bench import roofline
from bench.report import PERF, publish_table, run_info, write_json
from bench.throughput import progress_bar

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
DEFAULT_ROWS = (1, 8, 16, 32, 48, 64, 128, 256, 512)


def median_seconds(reps: int, fn: Callable[..., object], *args: object) -> float:
    fn(*args)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(rows: int, reps: int, shapes: dict[str, tuple[int, int]] = SHAPES) -> dict[str, float]:
    """Summed over `shapes` (default: all five), GFLOP/s of each path for `rows` rows."""
    from engine.kernels.cpu_build import cpu_kernels
    from engine.models import linear as lin

    flops = sum(2 * rows * n * k for n, k in shapes.values())
    seconds: dict[str, float] = {"mkl": 0.0, "onednn": 0.0, "onednn_packed": 0.0, "skinny": 0.0, "panel": 0.0,
                                 "bf16": 0.0}
    ops = cpu_kernels()
    skinny = ops.skinny_linear if ops is not None and rows <= lin.SKINNY_MAX_ROWS else None
    panel = ops.panel_linear if lin._panel_kernel() and rows <= lin.PANEL_MAX_ROWS else None
    for n, k in shapes.values():
        g = torch.Generator().manual_seed(n * k + rows)
        w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, lin.PACK_HINT_ROWS)
        onednn = torch.ops.mkldnn._linear_pointwise
        seconds["mkl"] += median_seconds(reps, torch.mm, x, w.t())
        seconds["onednn"] += median_seconds(reps, onednn, x, w, None, "none", [], "")
        seconds["onednn_packed"] += median_seconds(reps, onednn, x, packed, None, "none", [], "")
        if skinny is not None:
            seconds["skinny"] += median_seconds(reps, skinny, x, w, None)
        if panel is not None:
            seconds["panel"] += median_seconds(reps, panel, x, lin.prepack(w, compact=False), n, None)
        if rows >= lin.BF16_MIN_ROWS:
            with lin.prefill_step():
                seconds["bf16"] += median_seconds(reps, lin.linear, x, w, None, None, None, w.to(torch.bfloat16))
    return {path: flops / s / 1e9 for path, s in seconds.items() if s > 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS), help="row counts to measure")
    # The bf16 arm times the products only: it runs on any CPU, emulated (slowly) where bf16 instructions lack.
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES),
                    help="weight shapes to sum over (default: all five; a prefill runs all but lm_head on every row)")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per path and shape (the median counts)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = {name: SHAPES[name] for name in args.shapes}
    data = {**run_info("bench.kernels.linear_rates", args.threads), "shapes": shapes, "rows": {}}
    with progress_bar("linear rates", len(args.rows) + 1) as advance, torch.inference_mode():
        data["roof"] = roofline.measure_machine(5).to_dict()
        advance()
        for rows in args.rows:
            data["rows"][rows] = measure(rows, args.reps, shapes)
            advance()
    write_json("kernels/linear_rates.json", data)
    peak = data["roof"]["peak_gflops"]

    def cell(rates: dict, path: str) -> str:
        return f"{rates[path]:.0f}" if path in rates else "—"

    headers = ["rows", "skinny kernel", "MKL", "oneDNN", "oneDNN, packed", "panel kernel, packed", "best fp32 ÷ roof",
               "bf16 prefill path", "bf16 ÷ roof"]
    rows = [(r, cell(v, "skinny"), cell(v, "mkl"), cell(v, "onednn"), cell(v, "onednn_packed"), cell(v, "panel"),
             f"{max(x for p, x in v.items() if p != 'bf16') / peak:.0%}", cell(v, "bf16"),
             f"{v['bf16'] / peak:.0%}" if "bf16" in v else "—") for r, v in data["rows"].items()]
    title = (f"GFLOP/s over SmolLM2-135M's weight shapes {', '.join(shapes)} (roof: {peak:.0f} GFLOP/s, a 2048-row "
             "product)")
    publish_table(
        "linear_rates", "Linear products against the roof, by rows and path", data,
        f"the median of {args.reps} calls per path and weight shape, summed over SmolLM2-135M's "
        f"{', '.join(shapes)} weights.", title, headers, rows, docs=PERF / "kernels.md")

if __name__ == "__main__":
    main()
