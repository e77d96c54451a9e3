"""fp32 GFLOP/s of SmolLM2-135M's linear layers at decode-sized row counts, per CPU path.

    .venv/bin/python -m bench.kernels.linear_rates                 # rows 1, 8, 16, 32, 48, 64, 128, 256, 512
    .venv/bin/python -m bench.kernels.linear_rates --rows 32 64

For each row count and weight shape (random weights: only the shapes matter), the
median time of: the engine's skinny kernel (1-8 rows), MKL (`torch.mm`), oneDNN on
the plain weight, oneDNN on its packed copy (what `cpu_prepack_weights` keeps on CPUs
without AVX2), and the panel kernel on its packed copy (what it keeps on AVX2 and AVX-512
CPUs, up to 256 rows; engine/models/linear.py). Each weight is called repeatedly, so
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


def measure(rows: int, reps: int) -> dict[str, float]:
    """Summed over the five shapes, GFLOP/s of each path for `rows` rows."""
    from engine.kernels.cpu_build import cpu_kernels
    from engine.models import linear as lin

    flops = sum(2 * rows * n * k for n, k in SHAPES.values())
    seconds: dict[str, float] = {"mkl": 0.0, "onednn": 0.0, "onednn_packed": 0.0, "skinny": 0.0, "panel": 0.0}
    ops = cpu_kernels()
    skinny = ops.skinny_linear if ops is not None and rows <= lin.SKINNY_MAX_ROWS else None
    panel = ops.panel_linear if lin._panel_kernel() and rows <= lin.PANEL_MAX_ROWS else None
    for n, k in SHAPES.values():
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
    return {path: flops / s / 1e9 for path, s in seconds.items() if s > 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS), help="row counts to measure")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per path and shape (the median counts)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = {**run_info("bench.kernels.linear_rates", args.threads), "shapes": SHAPES, "rows": {}}
    with progress_bar("linear rates", len(args.rows) + 1) as advance, torch.inference_mode():
        data["roof"] = roofline.measure_machine(5).to_dict()
        advance()
        for rows in args.rows:
            data["rows"][rows] = measure(rows, args.reps)
            advance()
    write_json("kernels/linear_rates.json", data)
    peak = data["roof"]["peak_gflops"]

    def cell(rates: dict, path: str) -> str:
        return f"{rates[path]:.0f}" if path in rates else "—"

    headers = ["rows", "skinny kernel", "MKL", "oneDNN", "oneDNN, packed", "panel kernel, packed", "best ÷ roof"]
    rows = [(r, cell(v, "skinny"), cell(v, "mkl"), cell(v, "onednn"), cell(v, "onednn_packed"), cell(v, "panel"),
             f"{max(v.values()) / peak:.0%}") for r, v in data["rows"].items()]
    title = f"GFLOP/s over SmolLM2-135M's five weight shapes (roof: {peak:.0f} GFLOP/s, a 2048-row product)"
    publish_table(
        "linear_rates", "Decode-shaped products against the roof", data,
        f"the median of {args.reps} calls per path and weight shape, summed over SmolLM2-135M's qkv, o_proj, "
        "gate_up, down and LM-head weights.", title, headers, rows, docs=PERF / "kernels.md")

if __name__ == "__main__":
    main()
