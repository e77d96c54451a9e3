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
// Every output element is computed by the same sequence of operations (two FMA chains over K in steps of two
// vectors, one step of one vector, the horizontal sum, then the scalar tail), whatever the number of rows of x or
// the blocking, so results are batch-invariant (per instruction set: a vector is 8 or 16 floats).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <vector>

namespace {

using QVec = vec_loads::FVec;
using vec_loads::kLanes;
constexpr int NR = 4;  // weight rows per block

void int8_row_to_float(const int8_t* q, float* out, int64_t K) {
  int64_t k = 0;
  if constexpr (vec_loads::kSimd)
    for (; k + kLanes <= K; k += kLanes) vec_loads::bytes_to_float<true>(q + k).store(out + k);
  for (; k < K; ++k) out[k] = static_cast<float>(q[k]);
}

// NOTE: the module is built with -ffp-contract=off: q * scale + offset stays a multiply then an add.
void int4_row_to_float(const uint8_t* p, const at::Half* scale, const at::Half* offset, int64_t G, int64_t K,
                       float* out) {
  for (int64_t g = 0; g < K / G; ++g) {
    const float s = static_cast<float>(scale[g]), o = static_cast<float>(offset[g]);
    const QVec sv(s), ov(o);
    for (int64_t r = g * G; r < (g + 1) * G; r += 32) {
      const uint8_t* b = p + r / 2;
      if constexpr (vec_loads::kSimd) {
        for (int64_t j = 0; j < 16; j += kLanes) {  // bytes j..j+kLanes-1: inputs r+j.. (low), r+16+j.. (high)
          QVec lo, hi;
          vec_loads::nibble_floats(b + j, lo, hi);
          (lo * sv + ov).store(out + r + j);
          (hi * sv + ov).store(out + r + 16 + j);
        }
      } else {
        for (int j = 0; j < 16; ++j) {
          out[r + j] = static_cast<float>(b[j] & 0x0F) * s + o;
          out[r + 16 + j] = static_cast<float>(b[j] >> 4) * s + o;
        }
      }
    }
  }
}

// out[j] = x . w_j for `rows` weight rows (stride K) in the scratch.
template <int R>
void dot_rows(const float* x, const float* w, int64_t K, float* out) {
  QVec a0[R], a1[R];
  VEC_UNROLL
  for (int j = 0; j < R; ++j) a0[j] = a1[j] = QVec(0.f);
  int64_t k = 0;
  for (; k + 2 * kLanes <= K; k += 2 * kLanes) {
    const QVec x0 = QVec::loadu(x + k), x1 = QVec::loadu(x + k + kLanes);
    VEC_UNROLL
    for (int j = 0; j < R; ++j) {
      a0[j] = at::vec::fmadd(x0, QVec::loadu(w + j * K + k), a0[j]);
      a1[j] = at::vec::fmadd(x1, QVec::loadu(w + j * K + k + kLanes), a1[j]);
    }
  }
  if (k + kLanes <= K) {
    const QVec x0 = QVec::loadu(x + k);
    VEC_UNROLL
    for (int j = 0; j < R; ++j) a0[j] = at::vec::fmadd(x0, QVec::loadu(w + j * K + k), a0[j]);
    k += kLanes;
  }
  VEC_UNROLL
  for (int j = 0; j < R; ++j) {
    float s = vec_loads::reduce_add(a0[j] + a1[j]);
    for (int64_t kk = k; kk < K; ++kk) s += x[kk] * w[j * K + kk];
    out[j] = s;
  }
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
