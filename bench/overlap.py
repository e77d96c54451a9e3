"""How well one CPU core overlaps a memory stream with arithmetic, and what that allows a decode step.

    .venv/bin/python -m bench.overlap
    .venv/bin/python -m bench.overlap --rounds 5 --mib 2048 --throughput bench/results/throughput.json

A decode step streams the weights and every sequence's KV cache from memory and does its GEMMs'
arithmetic. bench.throughput bounds such a step two ways: the memory time and the compute time
taken in turns (the engine's structure: a layer's attention waits for its projections), and the
larger of the two (perfect overlap). Neither says what this machine can actually overlap. This
probe measures it on a synthetic loop with nothing else in it: every thread reads its share of a
buffer far larger than the caches, two cache lines at a time with a software prefetch a fixed
distance ahead, and between those loads runs independent FMA chains on registers, so neither
half waits for the other except through the core itself. Three arms, alternating round after
round in one process: the stream alone, the FMAs alone, both interleaved. At several FMA counts
per line (the arithmetic intensity) it reports the interleaved time over the longer arm (1.00 is
perfect overlap) and over the sum (1.00 is none).

With --throughput, the factor interpolated at each decode step's compute-to-memory ratio is applied
to the saved bench.throughput run: the highest compute-roofline share the decode steps at
batch >= 32 (and the whole workload) could reach if a layer's attention ran interleaved with the
GEMMs in one instruction stream, on this core. Writes bench/results/overlap.json and its section
of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys
from functools import cache
from pathlib import Path

import torch

from bench.report import REPO, RESULTS, publish_table, run_info, write_json
from bench.roofline import DecodeStepTimes, FlopModel

FMA_GROUPS_PER_LINE = (1, 2, 3, 4, 6, 8)
# Prefetch plans tried for the arms that stream, (hint, bytes ahead); hint 0 = T0 (into L1), 1 = T1 (L2), 2 = T2.
# Each arm's figure is its best plan, the plan most favourable to overlap.
PREFETCH_PLANS = ((0, 1024), (0, 4096), (1, 16384), (2, 65536))
MODES = {"stream": 1, "compute": 2, "both": 3}

# One probe call: `passes` passes over `buf`, split evenly between `threads` OpenMP threads. Per pair of
# cache lines: (mode & 1) prefetch the line pair `prefetch_bytes` ahead and add the pair into two vector
# sums; (mode & 2) run 2 * groups groups of 12 independent FMA chains on registers. Returns the seconds
# of the parallel region and the sum of every loaded float (passes * sum(buf) when the stream ran).
_SOURCE = r"""
#include <torch/extension.h>
#include <omp.h>
#include <vector>

typedef float v16 __attribute__((vector_size(64), aligned(64)));

template <int LOCALITY>
static inline void prefetch_pair(const float* p, int64_t off, int64_t ahead, int64_t per) {
  if (off + ahead < per) __builtin_prefetch(p + off + ahead, 0, LOCALITY);
  if (off + ahead + 16 < per) __builtin_prefetch(p + off + ahead + 16, 0, LOCALITY);
}

std::vector<double> overlap_probe(torch::Tensor buf, int64_t passes, int64_t groups, int64_t mode,
                                  int64_t prefetch_bytes, int64_t hint, int64_t threads) {
  TORCH_CHECK(buf.scalar_type() == torch::kFloat && buf.is_contiguous() && buf.dim() == 1, "1-D fp32 buffer");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(buf.data_ptr<float>()) % 64 == 0, "buffer not 64-byte aligned");
  TORCH_CHECK(threads >= 1 && passes >= 1 && groups >= 0 && prefetch_bytes >= 0 && mode >= 1 && mode <= 3 &&
              hint >= 0 && hint <= 2,
              "bad probe arguments");
  const int64_t per = buf.numel() / threads / 32 * 32;  // floats per thread, whole line pairs
  TORCH_CHECK(per >= 32, "buffer too small for ", threads, " threads");
  const float* base = buf.data_ptr<float>();
  const int64_t ahead = prefetch_bytes / 4;
  std::vector<double> sums(threads, 0.0);
  const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num();
    const float* p = base + tid * per;
    v16 a[12];
    for (int i = 0; i < 12; ++i) a[i] = v16{} + (1.0f + i * 1e-7f);
    const v16 m = v16{} + 0.999999f, c = v16{} + 1e-7f;
    v16 s0 = v16{}, s1 = v16{};
    for (int64_t pass = 0; pass < passes; ++pass) {
      for (int64_t off = 0; off < per; off += 32) {
        if (mode & 1) {
          if (hint == 0) prefetch_pair<3>(p, off, ahead, per);       // T0: into L1
          else if (hint == 1) prefetch_pair<2>(p, off, ahead, per);  // T1: into L2
          else prefetch_pair<1>(p, off, ahead, per);                 // T2
          s0 += *reinterpret_cast<const v16*>(p + off);
          s1 += *reinterpret_cast<const v16*>(p + off + 16);
        }
        if (mode & 2) {
          for (int64_t g = 0; g < 2 * groups; ++g) {
#pragma GCC unroll 12
            for (int i = 0; i < 12; ++i) a[i] = a[i] * m + c;
          }
        }
      }
    }
    double total = 0;
    for (int j = 0; j < 16; ++j) total += (double)s0[j] + (double)s1[j];
    float keep = 0;  // the FMA chains' results, so that they are computed
    for (int i = 0; i < 12; ++i) keep += a[i][0];
    sums[tid] = total + (keep == 12345.678f ? 1.0 : 0.0);
  }
  const double seconds = omp_get_wtime() - t0;
  double total = 0;
  for (double s : sums) total += s;
  return {seconds, total};
}
"""


@cache
def probe_module():
    from torch.utils.cpp_extension import load_inline

    from engine.kernels.cpu_build import build_flags

    flags = [*build_flags(), "-ffp-contract=fast"]
    return load_inline(name="infinilm_bench_overlap", cpp_sources=[_SOURCE], functions=["overlap_probe"],
                       extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)


def probe(buf: torch.Tensor, passes: int, groups: int, mode: int, threads: int, hint: int = 0,
          prefetch_bytes: int = 4096) -> tuple[float, float]:
    """(seconds, sum of every float loaded) for one call of the probe; see _SOURCE."""
    seconds, total = probe_module().overlap_probe(buf, passes, groups, mode, prefetch_bytes, hint, threads)
    return seconds, total


def arm_medians(seconds: dict[str, list[float]]) -> dict[str, float]:
    """Per arm, the median over rounds of its best prefetch plan: keys of `seconds` are "stream", "compute" and
    "both", or those with "@plan" appended."""
    medians: dict[str, float] = {}
    for key, values in seconds.items():
        arm = key.split("@")[0]
        medians[arm] = min(medians.get(arm, float("inf")), statistics.median(values))
    return medians


def overlap_factors(medians: dict[int, dict[str, float]]) -> list[dict]:
    """Per intensity: the arms' median seconds, the compute-to-stream ratio, and the interleaved time over the
    longer arm (`over_max`, 1.0 = perfect overlap) and over the sum (`over_sum`, 1.0 = no overlap)."""
    rows = []
    for groups in sorted(medians):
        m = medians[groups]
        longer, total = max(m["stream"], m["compute"]), m["stream"] + m["compute"]
        rows.append({"groups_per_line": groups, **m, "compute_over_stream": m["compute"] / m["stream"],
                     "over_max": m["both"] / longer, "over_sum": m["both"] / total})
    return rows


def factor_at(rows: list[dict], ratio: float) -> float:
    """`over_max` at a compute-to-memory ratio, linearly interpolated between the measured intensities and held
    constant beyond them."""
    points = sorted((r["compute_over_stream"], r["over_max"]) for r in rows)
    xs = [x for x, _ in points]
    i = bisect.bisect_left(xs, ratio)
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (ratio - x0) / (x1 - x0)


def decode_bounds(run: dict, rows: list[dict], flops: FlopModel, kv_token_bytes: int) -> dict:
    """The saved bench.throughput run's decode-only steps, bounded with GEMMs and attention overlapped as well as
    this core overlaps the probe's stream and FMAs: each step takes factor_at(c / m) * max(c, m), where c is its
    FLOPs at the GEMM peak and m its weights and KV at the read rate of that run, or its time with the GEMMs and
    attention in turns (bench.throughput's serial bound) where that is shorter: an engine could run either way."""
    rates, eng, roof = run["machine_rates"], run["engine"], run["roofline"]
    peak, bandwidth = rates["peak_gflops"] * 1e9, rates["read_gbps"] * 1e9
    min_batch, weight_bytes = roof["decode_min_batch"], roof["weight_bytes"]
    dec_c = dec_t = extra = 0.0
    for _, prefill, n, ctx in eng["steps"]:
        if prefill or not n:
            continue
        step = DecodeStepTimes.of(flops, n, ctx, weight_bytes, kv_token_bytes, peak, bandwidth)
        c, m = step.compute, step.memory
        t = min(step.in_turns, factor_at(rows, c / m) * max(c, m))
        extra += t - c
        if n >= min_batch:
            dec_c, dec_t = dec_c + c, dec_t + t
    return {"decode_share_bound_overlap": dec_c / dec_t if dec_t else None,
            "decode_share": roof["decode_share"], "decode_share_bound_serial": roof["decode_share_bound_serial"],
            "roofline_share_bound_overlap": roof["roofline_s"] / (roof["roofline_s"] + extra),
            "roofline_share": roof["roofline_share"], "roofline_share_bound_serial": roof["roofline_share_bound_serial"],
            "throughput_date": run["machine"]["date"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024, help="buffer size; far larger than the last-level cache")
    ap.add_argument("--rounds", type=int, default=5, help="alternations of the three arms (medians are compared)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--throughput", type=Path, default=RESULTS / "throughput.json", metavar="JSON",
                    help="a saved bench.throughput run to bound with the measured overlap ('' to skip)")
    args = ap.parse_args()
    if args.mib < 64 or args.rounds < 1 or args.threads < 1:
        sys.exit("--mib must be at least 64, --rounds and --threads at least 1")
    from bench.throughput import progress_bar

    per_lane = (args.mib << 18) // args.threads // 32  # ones each of the probe's fp32 vector lanes adds up
    if per_lane > 1 << 24:
        sys.exit(f"--mib {args.mib} is too large for {args.threads} threads: the probe's fp32 sums would no longer "
                 "count every float exactly; use more threads or at most "
                 f"{(1 << 24) * 32 * args.threads >> 18} MiB")
    buf = torch.ones(args.mib << 18)  # 4-byte floats; ones: the stream's sum is known
    expected = float(buf.numel() // args.threads // 32 * 32 * args.threads)
    with progress_bar("building the probe", 1) as advance:
        probe_module()
        advance()
    keys = ["compute", *(f"{arm}@{hint}:{ahead}" for hint, ahead in PREFETCH_PLANS for arm in ("stream", "both"))]
    seconds: dict[int, dict[str, list[float]]] = {g: {k: [] for k in keys} for g in FMA_GROUPS_PER_LINE}
    with progress_bar("stream / compute / both", len(FMA_GROUPS_PER_LINE) * (args.rounds + 1)) as advance:
        for groups in FMA_GROUPS_PER_LINE:
            for rnd in range(args.rounds + 1):  # round 0 warms up (page faults, frequency) and is dropped
                for key in keys:
                    arm, _, plan = key.partition("@")
                    hint, ahead = map(int, plan.split(":")) if plan else (0, 0)
                    t, total = probe(buf, 1, groups, MODES[arm], args.threads, hint, ahead)
                    if MODES[arm] & 1 and total != expected:
                        sys.exit(f"the probe's stream read {total} instead of {expected}: it is broken")
                    if rnd:
                        seconds[groups][key].append(t)
                advance()
    medians = {g: arm_medians(by_key) for g, by_key in seconds.items()}
    rows = overlap_factors(medians)
    data = {**run_info("bench.overlap", args.threads), "settings": {k: str(v) for k, v in vars(args).items()},
            "prefetch_plans": PREFETCH_PLANS, "seconds": seconds, "rows": rows}
    stream_gbps = buf.numel() * 4 / statistics.median(r["stream"] for r in rows) / 1e9
    extra = ""
    if str(args.throughput) not in ("", "."):
        try:
            run = json.loads(args.throughput.read_text())
            bounds = _bounds_for(run, rows)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            sys.exit(f"{args.throughput}: not a saved bench.throughput run ({type(exc).__name__}: {exc})")
        data["throughput_bounds"] = bounds
        shown = args.throughput.resolve()
        extra = _bounds_text(bounds, shown.relative_to(REPO) if shown.is_relative_to(REPO) else shown)
    write_json("overlap.json", data)
    table = [(r["groups_per_line"], f"{r['stream'] * 1e3:.0f}", f"{r['compute'] * 1e3:.0f}", f"{r['both'] * 1e3:.0f}",
              f"{r['compute_over_stream']:.2f}", f"{r['over_max']:.2f}", f"{r['over_sum']:.2f}") for r in rows]
    publish_table(
        "overlap", "Overlap of a memory stream and arithmetic on one core", data,
        f"{args.mib} MiB of fp32 read once per arm by {args.threads} threads (the stream alone ran at about "
        f"{stream_gbps:.1f} GB/s), two lines at a time with a software prefetch ahead (each streaming arm's best of "
        f"{len(PREFETCH_PLANS)} plans: T0 1 and 4 KiB, T1 16 KiB, T2 64 KiB ahead), against groups of 12 independent "
        f"FMA chains on registers; the arms alternate {args.rounds} times per intensity in "
        "one process and medians are compared. `both ÷ longer` is 1.00 where the core overlaps the two perfectly, "
        "`both ÷ sum` 1.00 where it does not overlap them at all.",
        "Stream, FMAs, and both interleaved in one instruction stream",
        ["FMA groups per line", "stream ms", "FMAs ms", "both ms", "FMAs ÷ stream", "both ÷ longer", "both ÷ sum"],
        table, extra)


def _bounds_for(run: dict, rows: list[dict]) -> dict:
    from bench import roofline
    from engine.model_registry import resolve_model
    from engine.models.config import ModelConfig

    mc = ModelConfig.from_folder(resolve_model("smollm2"))
    return decode_bounds(run, rows, roofline.FlopModel.from_config(mc), roofline.kv_bytes_per_token(mc))


def _bounds_text(b: dict, path: Path) -> str:
    def pct(x):
        return "—" if x is None else f"{100 * x:.1f}%"

    return "\n".join([
        f"Applied to the bench.throughput run in `{path.as_posix()}` (measured {b['throughput_date']}): the "
        "compute-roofline shares the engine reached, the highest its structure allows (GEMMs and attention in "
        "turns), and the highest if each decode-only step overlapped all its memory traffic with its arithmetic "
        "as well as this core overlaps the probe's (each step at `both ÷ longer`, interpolated at its "
        "FLOPs-to-bytes ratio, times the longer of its compute and memory times, or in turns where that is "
        "shorter). Both bounds take the GEMMs at the run's GEMM peak and the bytes at its read rate.",
        "",
        "| compute-roofline share | reached | bound, in turns | bound, overlapped on this core |",
        "|---|---:|---:|---:|",
        f"| decode-only steps at batch >= 32 | {pct(b['decode_share'])} | {pct(b['decode_share_bound_serial'])} | "
        f"{pct(b['decode_share_bound_overlap'])} |",
        f"| whole workload | {pct(b['roofline_share'])} | {pct(b['roofline_share_bound_serial'])} | "
        f"{pct(b['roofline_share_bound_overlap'])} |",
    ])


if __name__ == "__main__":
    main()
