"""The panel GEMM kernel against the other fp32 CPU linear paths, on a whole model's weights.

    .venv/bin/python -m bench.kernels.panel_gemm
    .venv/bin/python -m bench.kernels.panel_gemm --rows 1 32 64 --rounds 5
    .venv/bin/python -m bench.kernels.panel_gemm --base 9ccb5af   # also the kernel as it was at that commit
    .venv/bin/python -m bench.kernels.panel_gemm --huge-pages     # packed copies in huge pages, as the engine keeps them

One pass = every linear of SmolLM2-135M for one step of `rows` tokens: 30 layers' qkv, o_proj,
gate_up and down weights (random, distinct per layer, so that as in the model they stream from
memory rather than sit in cache) and the 49152-wide LM head. Three arms, each through
`engine.models.linear.linear`, alternating round after round in one process: the engine's
plain weights (no packed copy: the skinny kernel up to 8 rows, oneDNN at padded row buckets above),
oneDNN on its packed copy (what `cpu_prepack_weights` kept before the panel kernel), and the
panel kernel on its packed copy (what `cpu_prepack_weights` keeps on AVX2 and AVX-512 CPUs). With
`--base REV`, two more arms, both calling the kernel directly (without `linear`'s Python
dispatch): this tree's panel kernel, and the one built from engine/models/csrc/panel_gemm.cpp at
git revision REV (reading the same packed copy, where the two revisions pack alike), whose outputs must
equal this tree's bitwise. Rounds alternate the arms' order. Medians over
the rounds are compared. Writes bench/results/kernels/panel_gemm.json and its section of
docs/perf/kernels.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from bench.report import PERF, publish_table, run_info, write_json
from bench.throughput import progress_bar
from engine import hugepages

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o_proj, gate_up, down: (out, in)
HEAD_SHAPE = (49152, 576)
NUM_LAYERS = 30
DEFAULT_ROWS = (1, 8, 16, 32, 48, 64, 128, 256)
KERNEL = "engine/models/csrc/panel_gemm.cpp"


def build_weights(seed: int) -> list[dict[str, torch.Tensor | None]]:
    from engine.models import linear as lin

    g = torch.Generator().manual_seed(seed)
    shapes = [s for _ in range(NUM_LAYERS) for s in LAYER_SHAPES] + [HEAD_SHAPE]
    weights = []
    for n, k in shapes:
        w = torch.randn(n, k, generator=g) / k ** 0.5
        weights.append({"plain": w, "onednn": torch.ops.mkldnn._reorder_linear_weight(w, lin.PACK_HINT_ROWS),
                        "panel": lin.prepack(w, compact=False)})
    return weights


def one_pass(weights, xs: dict[int, torch.Tensor], arm: str, base=None) -> float:
    from engine.kernels.cpu_build import cpu_kernels
    from engine.models.linear import linear

    t0 = time.perf_counter()
    if arm in ("direct", "base"):  # this tree's kernel or the one at --base, called directly on its packing
        kernel = base if arm == "base" else cpu_kernels()
        for w in weights:
            kernel.panel_linear(xs[w["plain"].shape[1]], w[arm], w["plain"].shape[0], None)
    else:
        for w in weights:
            linear(xs[w["plain"].shape[1]], w["plain"], packed=None if arm == "plain" else w[arm])
    return time.perf_counter() - t0


def check_base(weights, xs: dict[int, torch.Tensor], base) -> None:
    """The kernel at --base must compute the same bits as this tree's (a timing of different work means nothing)."""
    from engine.models.linear import linear

    for w in weights[:4] + weights[-1:]:
        x, n = xs[w["plain"].shape[1]], w["plain"].shape[0]
        if not torch.equal(base.panel_linear(x, w["base"], n, None), linear(x, w["plain"], packed=w["panel"])):
            sys.exit(f"the panel kernel at --base and this tree's disagree on a {tuple(w['plain'].shape)} weight")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS), help="rows per pass (tokens in a step)")
    ap.add_argument("--rounds", type=int, default=7, help="alternations of the three arms (medians are compared)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--base", metavar="REV",
                    help="also time the panel kernel as it was at git revision REV (a fourth arm; its outputs must "
                         "equal this tree's bitwise)")
    ap.add_argument("--huge-pages", action="store_true",
                    help="keep the panel kernel's packed copies in transparent huge pages, as the engine keeps the "
                         "weights a decode step streams (memory.huge_pages auto); default: torch's 4 KiB pages")
    args = ap.parse_args()
    if args.huge_pages and not hugepages.available():
        sys.exit("--huge-pages: this host gives no transparent huge pages to madvised memory")
    if bad := [r for r in args.rows if not 1 <= r <= 256]:
        sys.exit(f"--rows must be between 1 and 256 (the packed copies' range), got {bad}")
    torch.set_num_threads(args.threads)
    from engine.models import linear as lin

    if not lin._panel_kernel():
        sys.exit("the panel kernel is not available here (it needs AVX2 or AVX-512 and the CPU extension); nothing to compare")
    arms = {"plain": "plain weights, no copy", "onednn": "oneDNN, packed", "panel": "panel kernel, packed"}
    base = None
    if args.base:
        from bench.kernels.git_kernel import build_at_revision

        base = build_at_revision(args.base, [KERNEL], ["pack_panels", "panel_linear"])
        arms["direct"] = "panel kernel, direct call"
        arms["base"] = f"panel kernel at {args.base}, direct call"
    flops_per_row = 2 * (NUM_LAYERS * sum(n * k for n, k in LAYER_SHAPES) + HEAD_SHAPE[0] * HEAD_SHAPE[1])
    seconds: dict[int, dict[str, list[float]]] = {r: {a: [] for a in arms} for r in args.rows}
    with torch.inference_mode():
        weights = build_weights(0)
        if args.huge_pages:
            arena = hugepages.HugePageArena(hugepages.arena_bytes([(w["panel"].shape, w["panel"].dtype) for w in weights]))
            for w in weights:
                w["panel"] = arena.take(w["panel"].shape, w["panel"].dtype).copy_(w["panel"])
        if base is not None:
            for w in weights:
                # Where the two revisions pack alike, both kernels read the same copy: separate copies sit at
                # different physical memory, which on the dev VM alone made identical kernels differ by ~10%.
                packed = base.pack_panels(w["plain"])
                w["base"], w["direct"] = (w["panel"] if torch.equal(packed, w["panel"]) else packed), w["panel"]
        with progress_bar("panel kernel A/B/C", len(args.rows) * args.rounds) as advance:
            for rows in args.rows:
                g = torch.Generator().manual_seed(rows)
                xs = {k: torch.randn(rows, k, generator=g) for k in (576, 1536)}
                for arm in arms:  # warm-up: oneDNN builds its primitives, pages are touched
                    one_pass(weights, xs, arm, base)
                if base is not None:
                    check_base(weights, xs, base)
                for r in range(args.rounds):
                    for arm in (arms if r % 2 == 0 else reversed(arms)):  # no arm always follows the same one
                        seconds[rows][arm].append(one_pass(weights, xs, arm, base))
                    advance()
    medians = {r: {a: statistics.median(v) for a, v in by_arm.items()} for r, by_arm in seconds.items()}
    data = {**run_info("bench.kernels.panel_gemm", args.threads), "settings": vars(args), "seconds": seconds,
            "medians": medians, "flops_per_row": flops_per_row}
    write_json("kernels/panel_gemm.json", data)

    headers = ["rows", *(f"{name} ms" for name in arms.values()), "panel GFLOP/s", "panel ÷ plain",
               "panel ÷ oneDNN packed", *([f"direct ÷ at {args.base}"] if base is not None else [])]
    table = []
    for rows, m in medians.items():
        table.append((rows, *(f"{m[a] * 1e3:.1f}" for a in arms), f"{flops_per_row * rows / m['panel'] / 1e9:.0f}",
                      f"{m['plain'] / m['panel']:.2f}×", f"{m['onednn'] / m['panel']:.2f}×",
                      *([f"{m['base'] / m['direct']:.2f}×"] if base is not None else [])))
    pages = "transparent huge pages" if args.huge_pages else "torch's 4 KiB pages"
    title = "All linears of one SmolLM2-135M step (30 layers + LM head), medians of alternating rounds"
    publish_table(
        "panel_gemm", "Panel GEMM kernel: the linears of a decode step", data,
        f"fp32, weights distinct per layer so that they stream from memory as in the model, the panel kernel's "
        f"packed copies in {pages}; the {len(arms)} arms "
        f"alternate {args.rounds} times per row count in one process and the medians are compared. Lower ms is "
        "faster; the ratios are speed-ups of the panel kernel"
        + (f" (the last: this tree's kernel over the one at {args.base}, both called directly, outputs bitwise "
           "equal)." if base is not None else "."), title, headers, table, docs=PERF / "kernels.md")


if __name__ == "__main__":
    main()
