// Weight-only quantized linears for the CPU: y = x @ dequant(w)^T (+ bias), x in fp32.
//
// int8: w [N, K] int8, one fp32 scale per output row (applied to the finished dot product).
// int4: w [N, K/2] bytes; within each run of 32 inputs byte j holds input j (low nibble) and
//       input j + 16 (high nibble); each group of G inputs has an fp16 scale and offset,
//       w = q * scale + offset (a multiply then an add, as the torch reference computes it).
//
// Decode-sized batches only stream the weights, so reading 1 or 1/2 byte per weight instead of 4
// is the whole gain. Each task dequantizes four weight rows into an L1 scratch and reuses them for
// every row of x. torch's packed int8/int4 CPU ops are slower than fp32 on AVX2 machines (they are
// tuned for AVX-512; docs/perf/engine-notes.md), hence this kernel.
//
// Every output element is computed by the same sequence of operations (two FMA chains over K in
// 16-float steps, one 8-float step, the horizontal sum, then the scalar tail), whatever the number
// of rows of x or the blocking, so results are batch-invariant.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QL_AVX2 1
#endif

namespace {

constexpr int NR = 4;  // weight rows per block

void int8_row_to_float(const int8_t* q, float* out, int64_t K) {
  int64_t k = 0;
#ifdef QL_AVX2
  for (; k + 8 <= K; k += 8)
    _mm256_storeu_ps(out + k, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                  reinterpret_cast<const __m128i*>(q + k)))));
#endif
  for (; k < K; ++k) out[k] = static_cast<float>(q[k]);
}

void int4_row_to_float(const uint8_t* p, const at::Half* scale, const at::Half* offset, int64_t G, int64_t K,
                       float* out) {
  for (int64_t g = 0; g < K / G; ++g) {
    const float s = static_cast<float>(scale[g]), o = static_cast<float>(offset[g]);
    for (int64_t r = g * G; r < (g + 1) * G; r += 32) {
      const uint8_t* b = p + r / 2;
#ifdef QL_AVX2
      const __m128i mask = _mm_set1_epi8(0x0F);
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
      const __m128i lo = _mm_and_si128(bytes, mask);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
      const __m256 sv = _mm256_set1_ps(s), ov = _mm256_set1_ps(o);
      auto cvt = [&](__m128i v) {
        return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), sv), ov);
      };
      _mm256_storeu_ps(out + r, cvt(lo));
      _mm256_storeu_ps(out + r + 8, cvt(_mm_srli_si128(lo, 8)));
      _mm256_storeu_ps(out + r + 16, cvt(hi));
      _mm256_storeu_ps(out + r + 24, cvt(_mm_srli_si128(hi, 8)));
#else
      for (int j = 0; j < 16; ++j) {
        out[r + j] = static_cast<float>(b[j] & 0x0F) * s + o;
        out[r + 16 + j] = static_cast<float>(b[j] >> 4) * s + o;
      }
#endif
    }
  }
}

// out[j] = x . w_j for `rows` weight rows (stride K) in the scratch.
template <int R>
void dot_rows(const float* x, const float* w, int64_t K, float* out) {
#ifdef QL_AVX2
  __m256 a0[R], a1[R];
  for (int j = 0; j < R; ++j) a0[j] = a1[j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
    for (int j = 0; j < R; ++j) {
      a0[j] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(w + j * K + k), a0[j]);
      a1[j] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(w + j * K + k + 8), a1[j]);
    }
  }
  if (k + 8 <= K) {
    const __m256 x0 = _mm256_loadu_ps(x + k);
    for (int j = 0; j < R; ++j) a0[j] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(w + j * K + k), a0[j]);
    k += 8;
  }
  for (int j = 0; j < R; ++j) {
    const __m256 s8 = _mm256_add_ps(a0[j], a1[j]);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s4 = _mm_hadd_ps(s4, s4);
    s4 = _mm_hadd_ps(s4, s4);
    float s = _mm_cvtss_f32(s4);
    for (int64_t kk = k; kk < K; ++kk) s += x[kk] * w[j * K + kk];
    out[j] = s;
  }
#else
  for (int j = 0; j < R; ++j) {
    float s = 0.f;
    for (int64_t kk = 0; kk < K; ++kk) s += x[kk] * w[j * K + kk];
    out[j] = s;
  }
#endif
}

// Shared driver: `fill(n, dst)` writes weight row n as floats; `row_scale(n)` multiplies the dot.
template <typename Fill, typename RowScale>
torch::Tensor run(const torch::Tensor& x, int64_t N, const c10::optional<torch::Tensor>& bias, Fill fill,
                  RowScale row_scale) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2, "quantized linear takes 2-d fp32 input");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  auto y = torch::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  torch::Tensor bc;
  const float* bp = nullptr;
  if (bias.has_value()) {
    bc = bias->to(torch::kFloat).contiguous();
    bp = bc.data_ptr<float>();
  }
  const int64_t blocks = (N + NR - 1) / NR;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    std::vector<float> scratch(NR * K);
    float out[NR];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NR, rows = std::min<int64_t>(NR, N - n0);
      for (int64_t j = 0; j < rows; ++j) fill(n0 + j, scratch.data() + j * K);
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = xp + m * K;
        if (rows == NR) dot_rows<NR>(xr, scratch.data(), K, out);
        else for (int64_t j = 0; j < rows; ++j) dot_rows<1>(xr, scratch.data() + j * K, K, out + j);
        for (int64_t j = 0; j < rows; ++j) {
          const int64_t n = n0 + j;
          yp[m * N + n] = out[j] * row_scale(n) + (bp ? bp[n] : 0.f);
        }
      }
    }
  });
  return y;
}

}  // namespace

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(w.scalar_type() == torch::kChar && w.dim() == 2 && w.size(1) == x.size(-1), "int8_linear: bad weight");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.numel() == w.size(0), "int8_linear: bad scales");
  auto wc = w.contiguous();
  auto sc = scales.contiguous();
  const int8_t* wp = wc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  const int64_t K = wc.size(1);
  return run(x, wc.size(0), bias, [&](int64_t n, float* dst) { int8_row_to_float(wp + n * K, dst, K); },
             [&](int64_t n) { return sp[n]; });
}

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor offset,
                          c10::optional<torch::Tensor> bias) {
  const int64_t K = x.size(-1);
  TORCH_CHECK(w.scalar_type() == torch::kByte && w.dim() == 2 && w.size(1) * 2 == K, "int4_linear: bad weight");
  TORCH_CHECK(scale.scalar_type() == torch::kHalf && offset.scalar_type() == torch::kHalf &&
              scale.size(0) == w.size(0) && scale.sizes() == offset.sizes(), "int4_linear: bad scale/offset");
  const int64_t groups = scale.size(1), G = K / groups;
  TORCH_CHECK(G * groups == K && G % 32 == 0, "int4_linear: the group size must be a multiple of 32");
  auto wc = w.contiguous();
  auto sc = scale.contiguous();
  auto oc = offset.contiguous();
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  const at::Half* sp = sc.data_ptr<at::Half>();
  const at::Half* op = oc.data_ptr<at::Half>();
  return run(x, wc.size(0), bias,
             [&](int64_t n, float* dst) { int4_row_to_float(wp + n * K / 2, sp + n * groups, op + n * groups, G, K, dst); },
             [](int64_t) { return 1.f; });
}
