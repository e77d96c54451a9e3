"""Can a decode step hide its attention's KV reads behind its GEMMs by prefetching them into the LLC?

    .venv/bin/python -m bench.llc_prefetch
    .venv/bin/python -m bench.llc_prefetch --rows 48 --context 400 --rounds 5

At batch >= 32 a decode step of SmolLM2-135M on this VM spends about half its time in the GEMMs
(bound by arithmetic) and half in decode attention (bound by reading the KV cache from memory),
one after the other. The idea probed here: while a layer's GEMMs run, software-prefetch the KV
rows that the next attention will read (prefetcht2, spread evenly over the GEMM's K steps), so
that they wait in the last-level cache and the attention reads them at cache speed.

The probe: for each of 30 layers, SmolLM2's four linears (qkv, o_proj, gate_up, down, each layer's
own fp32 weight panels, so that they stream from memory as in the engine) on `--rows` rows by the
panel kernel's 12-row tiles, which prefetch the next panel into L2 as the engine's do, then one
read of that layer's KV (its own buffer). Arms, alternating round after round in one process,
medians compared: no KV prefetch (the tile without the hook), and the KV prefetch at several rates
(lines per K step) and caps (MiB per layer).

The KV is one contiguous buffer per layer (the engine's is 12 KiB blocks in scattered order, which
only makes a prefetch harder) and the read is a plain sum, not attention, so that both halves are
each at their best. Writes bench/results/llc_prefetch.json and its section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from functools import cache
from pathlib import Path

import torch

from bench.report import publish_table, run_info, write_json

# The prefetch arms: (lines per K step, MiB per layer at most; 0 = all of the layer's KV).
PLANS = ((1.0, 0), (0.5, 0), (0.25, 8), (0.0625, 2))
LAYERS = 30

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <chrono>

namespace llcp {
constexpr int64_t kCols = 32;

// The thread's share of the KV to prefetch: lines [next, end) from p, `rate` lines per K step (16.16).
struct Background { const char* p = nullptr; int64_t next = 0, end = 0, acc = 0, rate = 0; };
static thread_local Background bg;

static double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Give thread t of `threads` its half (or share) of `lines` lines from p, at `rate`.
static void arm_background(const char* p, int64_t lines, int64_t rate) {
  const int64_t threads = at::get_num_threads();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) bg = {p, lines * t / threads, lines * (t + 1) / threads, 0, rate};
  });
}

// One 12-row x 32-column tile of the panel kernel (engine/models/csrc/panel_gemm.cpp): the next panel's
// `lines` lines from `ahead` go to L2 spread over the K steps; with BG, the thread's KV share as well.
template <bool BG>
static void tile(const float* a, int64_t lda, const float* panel, int64_t K, float* c, int64_t ldc,
                 const char* ahead, int64_t lines) {
  __m512 acc0[12], acc1[12];
  for (int i = 0; i < 12; ++i) { acc0[i] = _mm512_setzero_ps(); acc1[i] = _mm512_setzero_ps(); }
  const int64_t gap = lines > 0 ? (K << 16) / lines : 0;
  int64_t issued = 0, next = lines > 0 ? 0 : K;
  const char* bp = bg.p;
  int64_t bn = bg.next, bacc = bg.acc;
  const int64_t be = bg.end, brate = bg.rate;
  for (int64_t k = 0; k < K; ++k) {
    if (k == next) {
      _mm_prefetch(ahead + 64 * issued, _MM_HINT_T1);
      ++issued;
      next = issued < lines ? (issued * gap) >> 16 : K;
    }
    if (BG) {
      bacc += brate;
      for (; bacc >= 65536 && bn < be; bacc -= 65536) _mm_prefetch(bp + 64 * bn++, _MM_HINT_T2);
    }
    const __m512 b0 = _mm512_load_ps(panel + k * kCols), b1 = _mm512_load_ps(panel + k * kCols + 16);
    for (int i = 0; i < 12; ++i) {
      const __m512 av = _mm512_set1_ps(a[i * lda + k]);
      acc0[i] = _mm512_fmadd_ps(av, b0, acc0[i]);
      acc1[i] = _mm512_fmadd_ps(av, b1, acc1[i]);
    }
  }
  if (BG) { bg.next = bn; bg.acc = bacc; }
  for (int i = 0; i < 12; ++i) {
    _mm512_storeu_ps(c + i * ldc, acc0[i]);
    _mm512_storeu_ps(c + i * ldc + 16, acc1[i]);
  }
}

// y[M, 32 P] = x[M, K] . panels [P, K, 32]; M a multiple of 12.
template <bool BG>
static void gemm(const float* x, int64_t M, int64_t K, const float* w, int64_t P, float* y) {
  const int64_t ldc = P * kCols, tiles = M / 12, panel_lines = K * kCols * 4 / 64;
  const int64_t share = std::min((panel_lines + tiles - 1) / tiles, K);
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const float* panel = w + p * K * kCols;
      const char* nx = p + 1 < p1 ? reinterpret_cast<const char*>(panel + K * kCols) : nullptr;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t lines = nx ? std::max<int64_t>(0, std::min(share, panel_lines - t * share)) : 0;
        tile<BG>(x + 12 * t * K, K, panel, K, y + 12 * t * ldc + p * kCols, ldc, nx ? nx + 64 * t * share : nullptr,
                 lines);
      }
    }
  });
}

// Sum of buf by all threads, each its contiguous share, a T0 prefetch 4 KiB ahead.
static double read_sum(const float* p, int64_t n) {
  const int64_t threads = at::get_num_threads();
  std::vector<double> part(threads, 0.0);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t a = n * t / threads / 32 * 32, b = t + 1 == threads ? n : n * (t + 1) / threads / 32 * 32;
      __m512 s0 = _mm512_setzero_ps(), s1 = s0;
      int64_t i = a;
      for (; i + 32 <= b; i += 32) {
        _mm_prefetch(reinterpret_cast<const char*>(p + i + 1024), _MM_HINT_T0);
        s0 = _mm512_add_ps(s0, _mm512_loadu_ps(p + i));
        s1 = _mm512_add_ps(s1, _mm512_loadu_ps(p + i + 16));
      }
      double s = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
      for (; i < b; ++i) s += p[i];
      part[t] = s;
    }
  });
  double s = 0;
  for (double v : part) s += v;
  return s;
}
}  // namespace llcp

// Per layer, its four linears (weights[4 l .. 4 l + 3], panels [P, K, 32]) on x (K = 576) or h
// (K = 1536), the KV prefetch (rate lines per K step, at most cap_lines; rate 0: the tile without the hook),
// then one read of kvs[l]. Returns {GEMM seconds, read seconds, the reads' sum}.
std::vector<double> decode_layers(std::vector<torch::Tensor> weights, std::vector<torch::Tensor> kvs, torch::Tensor x,
                                  torch::Tensor h, torch::Tensor y, double rate, int64_t cap_lines) {
  using namespace llcp;
  const int64_t M = x.size(0);
  double gemm_s = 0, read_s = 0, sum = 0;
  for (size_t l = 0; l < kvs.size(); ++l) {
    const bool on = rate > 0;
    if (on)
      arm_background(reinterpret_cast<const char*>(kvs[l].data_ptr<float>()),
                     std::min<int64_t>(kvs[l].numel() * 4 / 64, cap_lines), static_cast<int64_t>(rate * 65536));
    auto t0 = std::chrono::steady_clock::now();
    for (int j = 0; j < 4; ++j) {
      const auto& w = weights[4 * l + j];
      const int64_t K = w.size(1), P = w.size(0);
      const float* in = K == x.size(1) ? x.data_ptr<float>() : h.data_ptr<float>();
      if (on) gemm<true>(in, M, K, w.data_ptr<float>(), P, y.data_ptr<float>());
      else gemm<false>(in, M, K, w.data_ptr<float>(), P, y.data_ptr<float>());
    }
    gemm_s += seconds_since(t0);
    auto t1 = std::chrono::steady_clock::now();
    sum += read_sum(kvs[l].data_ptr<float>(), kvs[l].numel());
    read_s += seconds_since(t1);
  }
  return {gemm_s, read_s, sum};
}
"""


def avx512() -> bool:
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@cache
def probe_module():
    from torch.utils.cpp_extension import load_inline

    return load_inline(name="infinilm_llc_prefetch_probe_v2", cpp_sources=[_SOURCE],
                       functions=["decode_layers"], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], verbose=False)


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=48, help="decode batch: rows of the GEMMs (a multiple of 12)")
    ap.add_argument("--context", type=int, default=400, help="KV rows per sequence (the KV read is rows x context)")
    ap.add_argument("--rounds", type=int, default=5, help="alternations of the arms (medians are compared)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    if args.rows < 12 or args.rows % 12 or args.context < 16 or args.rounds < 1 or args.threads < 1:
        sys.exit("--rows must be a positive multiple of 12, --context at least 16, --rounds and --threads at least 1")
    if not avx512():
        sys.exit("this probe needs an AVX-512 CPU (the panel kernel's tiles)")
    from bench.roofline import kv_bytes_per_token
    from bench.throughput import progress_bar
    from engine.kernels.cpu_build import load_kernels
    from engine.model_registry import resolve_model
    from engine.models.config import ModelConfig

    torch.set_num_threads(args.threads)
    mc = ModelConfig.from_folder(resolve_model("smollm2"))
    layer_kv = kv_bytes_per_token(mc) // mc.num_layers * args.rows * args.context
    kv_floats = layer_kv // 4 // 16 * 16
    shapes = [(mc.hidden_size, (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim),
              (mc.num_heads * mc.head_dim, mc.hidden_size), (mc.hidden_size, 2 * mc.intermediate_size),
              (mc.intermediate_size, mc.hidden_size)]
    with progress_bar("building the probe, packing weights", 1) as advance:
        probe_module()
        ops = load_kernels()
        gen = torch.Generator().manual_seed(0)
        weights = [ops.pack_panels(torch.randn(n, k, generator=gen)) for _ in range(LAYERS) for k, n in shapes]
        kvs = [torch.ones(kv_floats) for _ in range(LAYERS)]  # ones: every read's sum is known
        x, h = torch.randn(args.rows, mc.hidden_size), torch.randn(args.rows, mc.intermediate_size)
        y = torch.empty(args.rows, max(n for _, n in shapes) // 32 * 32 + 32)
        advance()
    m = probe_module()
    plans = [(0.0, 0), *PLANS]
    seconds = {p: {"gemm": [], "read": []} for p in plans}
    with progress_bar("rounds", args.rounds + 1) as advance:
        for rnd in range(args.rounds + 1):  # round 0 warms up and is dropped
            for rate, cap in plans:
                cap_lines = (cap << 14) if cap else 1 << 62
                gemm_s, read_s, total = m.decode_layers(weights, kvs, x, h, y, rate, cap_lines)
                if total != kv_floats * LAYERS:
                    sys.exit(f"the probe's reads summed {total} instead of {kv_floats * LAYERS}: it is broken")
                if rnd:
                    seconds[(rate, cap)]["gemm"].append(gemm_s)
                    seconds[(rate, cap)]["read"].append(read_s)
            advance()

    mib = layer_kv / 2**20
    base = seconds[(0.0, 0)]
    base_sum = _median_ms(base["gemm"]) + _median_ms(base["read"])
    rows = []
    for (rate, cap), r in seconds.items():
        gemm, read = _median_ms(r["gemm"]), _median_ms(r["read"])
        label = "no KV prefetch" if not rate else f"{rate:g} lines per K step, {f'{cap} MiB' if cap else 'all'} a layer"
        rows.append((label, f"{gemm:.1f}", f"{read:.1f}", f"{layer_kv * LAYERS / (read / 1e3) / 1e9:.1f}",
                      f"{gemm + read:.1f}", f"{base_sum / (gemm + read):.2f}×"))
    data = {**run_info("bench.llc_prefetch", args.threads), "settings": {k: str(v) for k, v in vars(args).items()},
            "layer_kv_bytes": layer_kv, "seconds": {f"{rate}:{cap}": v for (rate, cap), v in seconds.items()}}
    write_json("llc_prefetch.json", data)
    publish_table(
        "llc_prefetch", "Prefetching the next attention's KV into the LLC during the GEMMs (SmolLM2-135M, CPU)",
        data,
        f"{args.rows} decode rows over {args.context}-row contexts, so {mib:.1f} MiB of fp32 KV a layer; for each "
        "of 30 layers, SmolLM2's four linears by the panel kernel's 12-row tiles on the layer's own fp32 weight "
        "panels (streamed from memory as in the engine, the next panel prefetched into L2 as the engine's tiles "
        "do), then one read of the layer's KV by all threads; the KV prefetch arms send that layer's KV lines "
        "(prefetcht2) spread evenly over the GEMMs' K steps. The KV is a contiguous buffer per layer and the read "
        f"a plain sum, not attention, so each half is at its best; {args.rounds} alternating rounds in one "
        "process, medians. `speed ÷ none` is the arm without the prefetch over this arm, GEMMs and reads summed; "
        "above 1.00 the prefetch pays.",
        f"30 layers: four linears on {args.rows} rows, then each layer's KV read ({mib:.1f} MiB a layer)",
        ["KV prefetch during the GEMMs", "GEMMs ms", "reads ms", "read GB/s", "sum ms", "speed ÷ none"], rows)


if __name__ == "__main__":
    main()
