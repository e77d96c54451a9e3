// Packing compact panels (engine/models/compact_weights.py; the layout is panel_gemm.cpp's): per run of 32
// inputs of an fp32 weight, an fp16 scale (and for Q4_1 an fp16 offset) and integer codes that rebuild every
// value bit for bit, as gguf's dequantize computed them (a group with NaN or infinities has none):
//   affine4 (Q4_1):        fl(fl(code * scale) + offset), code in [0, 15], offset = the group's minimum;
//   sym8    (Q8_0, Q4_0):  fl(code * scale),              code in [-127, 127], scale may be negative.
// The scale is searched among the fp16 values next to an estimate ((max - min) / 15 for affine4; the largest
// magnitude over 127, 8 or 7 for sym8), in a fixed order, and a group takes the first that fits. One pass per
// group, written straight into the panels, threads over panels; the first group without a fit ends the search
// for that form, so a weight with arbitrary values costs about one group per thread. The packer then rebuilds
// the panels with the kernel's own code (rebuild_panel) and compares them bit for bit with the weight
// (compact_panels_match), so the search cannot make a panel wrong, only fail to find one. Nothing
// weight-sized is allocated besides the panels: where fresh memory is slow to fault in, packing through torch
// temporaries costs seconds (docs/perf/engine-notes.md).

#include <cstring>

namespace compact_codes {

using panel_gemm::FVec;
using panel_gemm::kCols;
using panel_gemm::kGroup;
using panel_gemm::kLanes;
constexpr int kGroupVecs = kGroup / kLanes;
constexpr int kSteps[5] = {0, -1, 1, -2, 2};  // fp16 ulps from the estimate, tried in this order

static inline float to_fp16(float x) { return static_cast<float>(c10::Half(x)); }

// `s` (an fp16 value >= 0, as fp32) moved by `steps` fp16 ulps, kept within [0, the largest finite fp16].
static inline float fp16_step(float s, int steps) {
  if (steps == 0) return s;
  const int bits = std::clamp(static_cast<int>(c10::Half(s).x) + steps, 0, 0x7BFF);
  return static_cast<float>(c10::Half(static_cast<uint16_t>(bits), c10::Half::from_bits()));
}

static inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

// Codes of one group x (kGroupVecs vectors) for scale s (offset o, or none), and whether they rebuild all of x bit
// for bit; a vector at a time, computed as rebuild_panel computes them (panel_gemm's mul_rn, and affine4_value for an
// offset). Every step is exact or correctly rounded, so both instruction sets find the same codes.
template <bool kAffine>
static inline bool fits(const FVec* x, float s, float o, float low, float high, int32_t* codes) {
  const FVec vs(s), div(s != 0.f ? s : 1.f), vo(o), lo(low), hi(high), zero(0.f);
  FVec q[kGroupVecs];
  VEC_UNROLL
  for (int h = 0; h < kGroupVecs; ++h) {
    const FVec centred = kAffine ? x[h] - vo : x[h];
    q[h] = s != 0.f ? at::vec::minimum(at::vec::maximum((centred / div).round(), lo), hi) : zero;
    q[h] = q[h] + zero;  // a rounded -0.0 becomes the +0.0 that the kernel's integer code 0 converts to
    const FVec r = kAffine ? panel_gemm::affine4_value(q[h], vs, vo) : panel_gemm::mul_rn(q[h], vs);
    alignas(64) float rebuilt[kLanes], want[kLanes];
    r.store(rebuilt);
    x[h].store(want);
    if (std::memcmp(rebuilt, want, sizeof rebuilt) != 0) return false;
  }
  VEC_UNROLL
  for (int h = 0; h < kGroupVecs; ++h) at::vec::convert_to_int_of_same_size(q[h]).store(codes + kLanes * h);
  return true;
}

// The group's 32 values, or false if one is NaN or infinite (x - x is 0 only for finite x).
static inline bool load_finite(const float* p, FVec* x) {
  bool finite = true;
  VEC_UNROLL
  for (int h = 0; h < kGroupVecs; ++h) {
    x[h] = FVec::loadu(p + kLanes * h);
    finite = finite && (x[h] - x[h]).zero_mask() == (1 << kLanes) - 1;
  }
  return finite;
}

static inline float group_min(const FVec* x) {
  FVec m = x[0];
  for (int h = 1; h < kGroupVecs; ++h) m = at::vec::minimum(m, x[h]);
  return at::vec::vec_reduce_all<float>([](FVec& a, FVec& b) { return at::vec::minimum(a, b); }, m);
}
static inline float group_max(const FVec* x) {
  FVec m = x[0];
  for (int h = 1; h < kGroupVecs; ++h) m = at::vec::maximum(m, x[h]);
  return at::vec::vec_reduce_all<float>([](FVec& a, FVec& b) { return at::vec::maximum(a, b); }, m);
}

static bool affine4_group(const float* p, float* scale, float* offset, int32_t* codes) {
  FVec x[kGroupVecs];
  if (!load_finite(p, x)) return false;
  const float lo = group_min(x), hi = group_max(x);
  if (bits_of(to_fp16(lo)) != bits_of(lo)) return false;  // the offset is an fp16 value
  const float estimate = to_fp16((hi - lo) / 15.f);
  for (int steps : kSteps) {
    const float s = fp16_step(estimate, steps);
    if (fits<true>(x, s, lo, 0.f, 15.f, codes)) {
      *scale = s;
      *offset = lo;
      return true;
    }
  }
  return false;
}

static bool sym8_group(const float* p, float* scale, int32_t* codes) {
  FVec x[kGroupVecs], a[kGroupVecs];
  if (!load_finite(p, x)) return false;
  VEC_UNROLL
  for (int h = 0; h < kGroupVecs; ++h) a[h] = x[h].abs();
  const float amax = group_max(a);
  for (float d : {127.f, 8.f, 7.f}) {
    const float estimate = to_fp16(amax / d);
    for (int steps : kSteps)
      for (float sign : {1.f, -1.f}) {
        const float s = fp16_step(estimate, steps) * sign;
        if (fits<false>(x, s, 0.f, -127.f, 127.f, codes)) {
          *scale = s;
          return true;
        }
      }
  }
  return false;
}

// Packs one kind into `out` ([P, G, block], the layout panel_gemm.cpp's rebuild_panel reads), panel by panel so
// that no two threads write one block (a 4-bit code byte holds columns j and j + 16); false at the first group
// without a fit. Padding columns past N keep zero scales, offsets and codes.
template <bool kAffine>
static bool pack_kind(const float* w, int64_t N, int64_t G, uint8_t* out) {
  constexpr int64_t block = kAffine ? panel_gemm::kAffine4Block : panel_gemm::kSym8Block;
  const int64_t P = (N + kCols - 1) / kCols, K = G * kGroup;
  std::atomic<bool> failed{false};
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    int32_t codes[kGroup];
    for (int64_t p = p0; p < p1 && !failed.load(std::memory_order_relaxed); ++p)
      for (int64_t g = 0; g < G; ++g) {
        uint8_t* blk = out + (p * G + g) * block;
        std::memset(blk, 0, block);
        for (int64_t c = 0; c < kCols && p * kCols + c < N; ++c) {
          const float* x = w + (p * kCols + c) * K + g * kGroup;
          float scale = 0.f, offset = 0.f;
          if (!(kAffine ? affine4_group(x, &scale, &offset, codes) : sym8_group(x, &scale, codes))) {
            failed.store(true, std::memory_order_relaxed);
            return;
          }
          const uint16_t sh = c10::Half(scale).x;
          std::memcpy(blk + 2 * c, &sh, 2);
          if constexpr (kAffine) {
            const uint16_t oh = c10::Half(offset).x;
            std::memcpy(blk + 64 + 2 * c, &oh, 2);
            uint8_t* body = blk + 128;  // per step 16 bytes: column j low nibble, column j + 16 high
            for (int64_t k = 0; k < kGroup; ++k)
              body[16 * k + (c & 15)] |= static_cast<uint8_t>(codes[k] << (c >= 16 ? 4 : 0));
          } else {
            int8_t* body = reinterpret_cast<int8_t*>(blk + 64);  // per step 32 int8 codes, one per column
            for (int64_t k = 0; k < kGroup; ++k) body[kCols * k + c] = static_cast<int8_t>(codes[k]);
          }
        }
      }
  });
  return !failed.load();
}

}  // namespace compact_codes

// Whether compact panels `packed` ([P, K / 32, block], uint8) rebuild `weight` ([N, K] fp32) bit for bit, each panel
// rebuilt by the kernel's own rebuild_panel into a small scratch (nothing weight-sized is allocated).
bool compact_panels_match(torch::Tensor packed, torch::Tensor weight) {
  using namespace panel_gemm;
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat && weight.is_contiguous(),
              "compact_panels_match: weight must be a contiguous 2-D fp32 tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t block = checked_compact(packed, N, "compact_panels_match");
  TORCH_CHECK(packed.size(1) * kGroup == K, "compact_panels_match: ", packed.size(1), " groups do not cover ", K,
              " inputs");
  const int64_t P = packed.size(0), G = packed.size(1);
  const uint8_t* src = packed.data_ptr<uint8_t>();
  const uint32_t* wb = reinterpret_cast<const uint32_t*>(weight.data_ptr<float>());
  std::atomic<bool> equal{true};
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    float* panel = panel_scratch(K * kCols);
    for (int64_t p = p0; p < p1 && equal.load(std::memory_order_relaxed); ++p) {
      rebuild_panel(src + p * G * block, G, block, panel);
      const uint32_t* pb = reinterpret_cast<const uint32_t*>(panel);
      for (int64_t c = 0; c < kCols && p * kCols + c < N; ++c)
        for (int64_t k = 0; k < K; ++k)
          if (pb[k * kCols + c] != wb[(p * kCols + c) * K + k]) {
            equal.store(false, std::memory_order_relaxed);
            return;
          }
    }
  });
  return equal.load();
}

// `weight` ([N, K] fp32, K a multiple of 32) as compact panels for panel_linear: affine4 where every group fits
// that form, else sym8, else an empty tensor. The caller checks them with compact_panels_match before use.
torch::Tensor pack_compact_panels(torch::Tensor weight) {
  using namespace compact_codes;
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat && weight.device().is_cpu(),
              "pack_compact_panels: weight must be a 2-D fp32 CPU tensor, got ", weight.sizes(), " ",
              weight.scalar_type());
  TORCH_CHECK(weight.size(1) % kGroup == 0, "pack_compact_panels: in_features (", weight.size(1),
              ") must be a multiple of ", kGroup);
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), G = w.size(1) / kGroup, P = (N + kCols - 1) / kCols;
  if (N == 0 || G == 0) return torch::empty({0}, torch::kByte);
  for (const bool affine : {true, false}) {
    auto out = torch::empty({P, G, affine ? panel_gemm::kAffine4Block : panel_gemm::kSym8Block}, torch::kByte);
    const bool packed = affine ? pack_kind<true>(w.data_ptr<float>(), N, G, out.data_ptr<uint8_t>())
                               : pack_kind<false>(w.data_ptr<float>(), N, G, out.data_ptr<uint8_t>());
    if (packed) return out;
  }
  return torch::empty({0}, torch::kByte);
}
