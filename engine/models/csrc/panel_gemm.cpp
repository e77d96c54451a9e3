// Linear layers for 1-256 rows (decode batches and short prefill chunks) on AVX-512 CPUs:
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) over a weight packed once into panels of 32
// output columns, each panel's K x 32 floats contiguous (pack_panels).
//
// Why: oneDNN and MKL run these row counts at a fraction of the machine's GEMM rate. Per panel
// a task computes every row of x against it in register tiles of up to 12 rows x 32 columns
// (24 accumulators); the panel is read once from memory and then from L2, and while a panel is
// computed the next one is prefetched into L2, spread over the tiles' K steps, so the weight
// stream overlaps the arithmetic. Measured in bench/panel_gemm.py.
//
// Every output element is one FMA chain over k = 0..K-1 in order, then + bias: a row's result
// does not depend on how many rows share the call, how they are tiled or which thread runs them.

#if defined(__AVX512F__)
#include <immintrin.h>

namespace panel_gemm {

constexpr int64_t kCols = 32;
constexpr int kMaxTileRows = 12;

// The tile sends the first `lines` lines from `prefetch` to L2: PF = 1 or 2 a K step from k = 0 (lines <= PF * K);
// PF = 0 spreads fewer lines than steps evenly over the steps, one every K / lines (16.16 fixed point).
// Bunched into the first steps, a share asks for lines faster than one core's misses can be served (one
// a step is about the core's whole memory rate at 12-row tiles); the likely cost is the tile's own loads
// queueing behind those misses. Spread, the same lines come at the rate the panel is computed.
template <int MR, int PF>
static void tile(const float* a, int64_t lda, const float* panel, int64_t K, float* c, int64_t ldc,
                 const float* bias, __mmask16 m0, __mmask16 m1, const char* prefetch, int64_t lines) {
  __m512 acc0[MR], acc1[MR];
  for (int i = 0; i < MR; ++i) {
    acc0[i] = _mm512_setzero_ps();
    acc1[i] = _mm512_setzero_ps();
  }
  const int64_t steps = PF > 0 ? lines / (PF > 0 ? PF : 1) : 0;
  const int64_t gap = PF == 0 && lines > 0 ? (K << 16) / lines : 0;
  int64_t issued = 0, next = PF == 0 && lines > 0 ? 0 : K;
  for (int64_t k = 0; k < K; ++k) {
    if (k < steps) {
      _mm_prefetch(prefetch + 64 * PF * k, _MM_HINT_T1);
      if (PF == 2) _mm_prefetch(prefetch + 64 * PF * k + 64, _MM_HINT_T1);
    }
    if (PF == 0 && k == next) {
      _mm_prefetch(prefetch + 64 * issued, _MM_HINT_T1);
      ++issued;
      next = issued < lines ? (issued * gap) >> 16 : K;
    }
    const __m512 b0 = _mm512_load_ps(panel + k * kCols), b1 = _mm512_load_ps(panel + k * kCols + 16);
    for (int i = 0; i < MR; ++i) {
      const __m512 av = _mm512_set1_ps(a[i * lda + k]);
      acc0[i] = _mm512_fmadd_ps(av, b0, acc0[i]);
      acc1[i] = _mm512_fmadd_ps(av, b1, acc1[i]);
    }
  }
  const __m512 bias0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 bias1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
  for (int i = 0; i < MR; ++i) {
    _mm512_mask_storeu_ps(c + i * ldc, m0, _mm512_add_ps(acc0[i], bias0));
    _mm512_mask_storeu_ps(c + i * ldc + 16, m1, _mm512_add_ps(acc1[i], bias1));
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, const float*, __mmask16,
                        __mmask16, const char*, int64_t);
// [PF][rows]
static const TileFn kTiles[3][kMaxTileRows + 1] = {
    {nullptr, tile<1, 0>, tile<2, 0>, tile<3, 0>, tile<4, 0>, tile<5, 0>, tile<6, 0>, tile<7, 0>, tile<8, 0>,
     tile<9, 0>, tile<10, 0>, tile<11, 0>, tile<12, 0>},
    {nullptr, tile<1, 1>, tile<2, 1>, tile<3, 1>, tile<4, 1>, tile<5, 1>, tile<6, 1>, tile<7, 1>, tile<8, 1>,
     tile<9, 1>, tile<10, 1>, tile<11, 1>, tile<12, 1>},
    {nullptr, tile<1, 2>, tile<2, 2>, tile<3, 2>, tile<4, 2>, tile<5, 2>, tile<6, 2>, tile<7, 2>, tile<8, 2>,
     tile<9, 2>, tile<10, 2>, tile<11, 2>, tile<12, 2>}};

static inline __mmask16 lanes(int64_t n) { return n >= 16 ? 0xFFFF : (n <= 0 ? 0 : (__mmask16)((1u << n) - 1)); }

}  // namespace panel_gemm
#endif

bool panel_gemm_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

torch::Tensor pack_panels(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat && w.device().is_cpu(),
              "pack_panels takes a 2-D fp32 CPU weight [out_features, in_features]");
  const int64_t N = w.size(0), K = w.size(1), P = (N + 31) / 32;
  auto padded = torch::zeros({P * 32, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  // [P, 32, K] -> [P, K, 32]: panel p, step k holds w[32p .. 32p+31, k]. 64-byte aligned by torch's allocator.
  return padded.view({P, 32, K}).transpose(1, 2).contiguous();
}

torch::Tensor panel_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                           c10::optional<torch::Tensor> bias) {
#if defined(__AVX512F__)
  using namespace panel_gemm;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && packed.scalar_type() == torch::kFloat,
              "panel_linear takes fp32 x [rows, in_features]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.is_contiguous(),
              "panel_linear needs a weight from pack_panels");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), N = out_features;
  TORCH_CHECK(packed.size(1) == K, "panel_linear: x has ", K, " features, the packed weight ", packed.size(1));
  TORCH_CHECK(N > (P - 1) * kCols && N <= P * kCols, "panel_linear: out_features ", N, " does not match the packing");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == torch::kFloat),
              "panel_linear: bias must be ", N, " contiguous fp32 values");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr<float>()) % 64 == 0, "panel_linear: packed weight not aligned");
  // Rows may be strided (a column slice of a wider tensor, like the gate half of gate_up): no copy.
  auto xc = x.stride(1) == 1 && x.stride(0) >= K ? x : x.contiguous();
  const int64_t lda = xc.stride(0);
  auto y = torch::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Rows split into equal tiles of at most 12 (50 rows: five of 10, not four of 12 and one of 2).
  const int64_t ntiles = (M + kMaxTileRows - 1) / kMaxTileRows, per = (M + ntiles - 1) / ntiles;
  // Each tile prefetches its share of the next panel into L2, spread over its K steps: one line per step,
  // or two where a single tile holds every row from 4 rows up (the panel's lines are 2 x K, so one line
  // per step would leave half of it to the hardware prefetcher). Below 4 rows a step is too short for two.
  // From 3 tiles up a share is fewer lines than steps, and goes out evenly over all of them (tile<.., 0>):
  // 1.06-1.14x at 32-64 rows over sending one a step from k = 0, bitwise the same.
  // `.venv/bin/python -m bench.panel_gemm --base REV` times this against an earlier commit's kernel.
  const int64_t panel_lines = K * kCols * 4 / 64;
  const int64_t pf = ntiles == 1 && M >= 4 ? 2 : 1;
  const int64_t share = std::min((panel_lines + ntiles - 1) / ntiles, pf * K);  // lines per tile
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = std::min<int64_t>(kCols, N - p * kCols);
      const __mmask16 m0 = lanes(cols), m1 = lanes(cols - 16);
      const float* panel = wp + p * K * kCols;
      const char* next = p + 1 < p1 ? reinterpret_cast<const char*>(panel + K * kCols) : nullptr;
      int64_t t = 0;
      for (int64_t m = 0; m < M; m += per, ++t) {
        const int64_t rows = std::min(per, M - m);
        int64_t lines = 0;
        const char* ahead = nullptr;
        if (next) {
          ahead = next + 64 * t * share;
          lines = std::max<int64_t>(0, std::min(share, panel_lines - t * share));
        }
        const TileFn fn = kTiles[lines < pf * K ? 0 : pf][rows];
        fn(xp + m * lda, lda, panel, K, yp + m * N + p * kCols, N, bp ? bp + p * kCols : nullptr, m0, m1, ahead, lines);
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "panel_linear needs AVX-512 (panel_gemm_available() is false on this CPU)");
  return x;
#endif
}
