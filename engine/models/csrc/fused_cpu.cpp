// Fused elementwise kernels for the fp32 decoder on the CPU: RMSNorm (alone, or after adding a
// layer's output into the residual stream) and rotary embeddings applied in place.
//
// At decode batch sizes each of these is a few hundred floats per row, and the ATen versions
// run as chains of small ops (pow, mean, add, rsqrt, mul, mul for one norm; index, mul, sub,
// mul, add per tensor for RoPE), so their cost is mostly per-op dispatch: over 30 layers, several
// milliseconds of a single-stream step (docs/BENCHMARKS.md). Each row is computed on its own by
// one fixed sequence of operations, whatever the number of rows: results are batch-invariant.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <cmath>

namespace {

using FVec = at::vec::Vectorized<float>;
constexpr int64_t kFV = FVec::size();

// out = x / sqrt(mean(x^2) + eps) * w for one row of D floats.
inline void rms_row(const float* x, const float* w, float* out, int64_t D, float eps) {
  FVec acc(0.f);
  int64_t d = 0;
  for (; d + kFV <= D; d += kFV) {
    const FVec v = FVec::loadu(x + d);
    acc = at::vec::fmadd(v, v, acc);
  }
  float ss = at::vec::vec_reduce_all<float>([](FVec& a, FVec& b) { return a + b; }, acc);
  for (; d < D; ++d) ss += x[d] * x[d];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
  const FVec rv(r);
  for (d = 0; d + kFV <= D; d += kFV) (FVec::loadu(x + d) * rv * FVec::loadu(w + d)).store(out + d);
  for (; d < D; ++d) out[d] = x[d] * r * w[d];
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.device().is_cpu(), name, " must be an fp32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

// Rows per task: enough that a task is worth a thread's wake-up.
constexpr int64_t kRowGrain = 32;

}  // namespace

// rms_norm(x) * w for x [rows, D] (rows may be strided); a new contiguous tensor.
torch::Tensor rms_norm_rows(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1) && w.scalar_type() == torch::kFloat,
              "weight must be contiguous fp32 of the row width");
  const int64_t rows = x.size(0), D = x.size(1), xs = x.stride(0);
  auto out = torch::empty({rows, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_row(xp + r * xs, wp, op + r * D, D, static_cast<float>(eps));
  });
  return out;
}

// residual += delta (in place), then rms_norm(residual) * w as a new tensor: the residual add of
// one sub-block and the norm in front of the next, in one pass over the rows.
torch::Tensor add_rms_norm_rows(torch::Tensor residual, torch::Tensor delta, torch::Tensor w, double eps) {
  check_rows(residual, "residual");
  check_rows(delta, "delta");
  TORCH_CHECK(residual.sizes() == delta.sizes(), "residual and delta must have the same shape");
  TORCH_CHECK(w.is_contiguous() && w.numel() == residual.size(1) && w.scalar_type() == torch::kFloat,
              "weight must be contiguous fp32 of the row width");
  const int64_t rows = residual.size(0), D = residual.size(1), rs = residual.stride(0), ds = delta.stride(0);
  auto out = torch::empty({rows, D}, residual.options());
  float* rp = residual.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* x = rp + r * rs;
      at::vec::map2([](FVec a, FVec b) { return a + b; }, x, x, dp + r * ds, D);
      rms_row(x, wp, op + r * D, D, static_cast<float>(eps));
    }
  });
  return out;
}

// Rotary embedding in place on q [T, H, D] and k [T, KH, D] (views: each head's D floats
// contiguous), rotate-half layout: with c, s the first half of row positions[t] of the cos and
// sin tables [P, D], x1' = x1 c - x2 s and x2' = x2 c + x1 s.
void rope_rows_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions) {
  for (const auto* t : {&q, &k}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->dim() == 3 && t->stride(2) == 1,
                "q and k must be fp32 [tokens, heads, head_dim] with contiguous heads");
  }
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2 &&
              cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat,
              "cos and sin must be contiguous fp32 tables of one shape");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.dim() == 1 && positions.is_contiguous(),
              "positions must be a contiguous int64 vector");
  const int64_t T = q.size(0), D = q.size(2), half = D / 2, P = cos.size(0);
  TORCH_CHECK(k.size(0) == T && k.size(2) == D && positions.size(0) == T && cos.size(1) == D && D % 2 == 0,
              "q, k, positions and the tables disagree in shape");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position ", pos[t], " outside the RoPE table");
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  struct View { float* p; int64_t heads, s0, s1; };
  const View views[2] = {{q.data_ptr<float>(), q.size(1), q.stride(0), q.stride(1)},
                         {k.data_ptr<float>(), k.size(1), k.stride(0), k.stride(1)}};
  at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + pos[t] * D;
      const float* s = sp + pos[t] * D;
      for (const View& v : views) {
        for (int64_t h = 0; h < v.heads; ++h) {
          float* x1 = v.p + t * v.s0 + h * v.s1;
          float* x2 = x1 + half;
          int64_t d = 0;
          for (; d + kFV <= half; d += kFV) {
            const FVec a = FVec::loadu(x1 + d), b = FVec::loadu(x2 + d);
            const FVec cv = FVec::loadu(c + d), sv = FVec::loadu(s + d);
            (a * cv - b * sv).store(x1 + d);
            (b * cv + a * sv).store(x2 + d);
          }
          for (; d < half; ++d) {
            const float a = x1[d], b = x2[d];
            x1[d] = a * c[d] - b * s[d];
            x2[d] = b * c[d] + a * s[d];
          }
        }
      }
    }
  });
}

// Floats per vector of ATen's own kernels in this process (cpu_build.py sets it from
// torch.backends.cpu.get_cpu_capability() as it loads the module): 16 where ATen runs AVX-512, else 8.
static int64_t torch_vector_lanes = 8;
void set_torch_vector_lanes(int64_t lanes) {
  TORCH_CHECK(lanes == 8 || lanes == 16, "set_torch_vector_lanes: 8 or 16, got ", lanes);
  torch_vector_lanes = lanes;
}

// SwiGLU's activation in place: for gate_up [rows, 2 * intermediate] (rows may be strided), the
// first `intermediate` columns become silu(gate) * up. Each element is computed as torch computes
// F.silu(gate, inplace=True).mul_(up) on the gate half's rows: x / (1 + exp(-x)) with ATen's
// vectorized exp over each row's leading multiple of two vectors, the scalar formula with std::exp
// for the rest of the row (ATen's elementwise loop does the same), then the product. So the result
// is bitwise torch's (tests/unit/test_fused_cpu_kernels.py), in one pass over gate and up instead of
// two over gate.
void silu_mul_rows_(torch::Tensor gate_up, int64_t intermediate) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(intermediate > 0 && gate_up.size(1) == 2 * intermediate, "gate_up must be [rows, 2 * ",
              intermediate, "], got ", gate_up.sizes());
  const int64_t rows = gate_up.size(0), ld = gate_up.stride(0), I = intermediate;
  // torch's loop vectorizes in steps of two of its own vectors, whose width is the instruction set ATen dispatches
  // to in this process (the host's best, whatever this module is built for): the same split keeps the bits.
  const int64_t step = 2 * std::max<int64_t>(kFV, torch_vector_lanes);
  const int64_t vec_end = I / step * step;
  float* p = gate_up.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 32768 / I);  // about 32k elements per task, as ATen's elementwise ops
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    const FVec one(1.f);
    for (int64_t r = r0; r < r1; ++r) {
      float* g = p + r * ld;
      const float* u = g + I;
      for (int64_t i = 0; i < vec_end; i += kFV) {
        const FVec x = FVec::loadu(g + i);
        (x / (one + x.neg().exp()) * FVec::loadu(u + i)).store(g + i);
      }
      for (int64_t i = vec_end; i < I; ++i) {
        const float x = g[i];
        const float silu = x / (1.f + std::exp(-x));
        g[i] = silu * u[i];
      }
    }
  });
}

// Greedy choice per row of fp32 logits [rows, vocab]: the first index of the row's maximum, as
// torch's max(dim).indices gives it, NaN included (a NaN is the maximum; the first NaN wins). One
// pass per row in vectors (AVX2 or AVX-512), each lane keeping its own first maximum; rows run in parallel.
// Why: for one row of a 49k vocabulary, torch's max runs one scalar thread, ~0.1 ms a decode step.
torch::Tensor argmax_rows(torch::Tensor logits) {
  check_rows(logits, "argmax_rows: logits");
  const int64_t R = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(V > 0, "argmax_rows: logits have no columns");
  auto out = torch::empty({R}, torch::kLong);
  const float* base = logits.data_ptr<float>();
  int64_t* idx = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = base + r * ld;
      int64_t v = 0, best_i = 0;
      float best = x[0];
      bool nan = false;
      if (vec_loads::kSimd && V >= kFV && V <= INT32_MAX) {  // lane indices are int32
        using IVec = at::vec::Vectorized<int32_t>;
        FVec mx = FVec::loadu(x);
        IVec mi = IVec::arange(0, 1), cur = mi;
        const IVec step(static_cast<int32_t>(kFV));
        FVec unordered = mx.isnan();
        for (v = kFV; v + kFV <= V; v += kFV) {
          cur = cur + step;
          const FVec xv = FVec::loadu(x + v);
          unordered = unordered | xv.isnan();
          const FVec gt = xv > mx;  // strictly greater: a lane keeps its first
          mx = FVec::blendv(mx, xv, gt);
          mi = IVec::blendv(mi, cur, at::vec::cast<int32_t>(gt));
        }
        nan = unordered.zero_mask() != (1 << kFV) - 1;
        if (!nan) {
          alignas(64) float vals[kFV];
          alignas(64) int32_t ids[kFV];
          mx.store(vals);
          mi.store(ids);
          best = vals[0];
          best_i = ids[0];
          for (int l = 1; l < kFV; ++l)
            if (vals[l] > best || (vals[l] == best && ids[l] < best_i)) best = vals[l], best_i = ids[l];
        }
      }
      if (v == 0) v = 1;  // x[0] is the maximum so far
      for (; v < V && !nan; ++v) {
        if (std::isnan(x[v])) nan = true;
        else if (x[v] > best) best = x[v], best_i = v;
      }
      if (nan || std::isnan(x[0])) {
        best_i = 0;
        while (!std::isnan(x[best_i])) ++best_i;
      }
      idx[r] = best_i;
    }
  });
  return out;
}
