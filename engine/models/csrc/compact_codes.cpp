// The search behind compact panels (engine/models/compact_weights.py): per run of 32 inputs of an fp32
// weight, an fp16 scale (and for Q4_1 an fp16 offset) and integer codes that rebuild every value bit for
// bit, as gguf's dequantize computed them (a group with NaN or infinities has none):
//   affine4 (Q4_1):        fl(fl(code * scale) + offset), code in [0, 15], offset = the group's minimum;
//   sym8    (Q8_0, Q4_0):  fl(code * scale),              code in [-127, 127], scale may be negative.
// The scale is searched among the fp16 values next to an estimate ((max - min) / 15 for affine4; the largest
// magnitude over 127, 8 or 7 for sym8), in a fixed order, and a group takes the first that fits. One pass per
// group, threads over rows; the first group without a fit ends the search for that form, so a weight with
// arbitrary values costs about one group. The packer still checks the panels it builds from these codes by
// rebuilding the weight with the kernel itself (unpack_compact_panels), so this search cannot make a panel
// wrong, only fail to find one.

#include <cstring>

namespace compact_codes {

constexpr int64_t kGroup = 32;
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

// The product, rounded, kept from being contracted with the add that follows into one FMA.
static inline float mul_rounded(float a, float b) {
  float p = a * b;
  asm volatile("" : "+x"(p));
  return p;
}

// Codes of one group for scale s (offset o, or none), and whether they rebuild all of x bit for bit.
template <bool kAffine>
static inline bool fits(const float* x, float s, float o, int low, int high, int16_t* codes) {
  const float div = s != 0.f ? s : 1.f;
  for (int64_t j = 0; j < kGroup; ++j) {
    const float centred = kAffine ? x[j] - o : x[j];
    float q = s != 0.f ? std::clamp(std::nearbyint(centred / div), static_cast<float>(low), static_cast<float>(high))
                       : 0.f;
    q += 0.f;  // a rounded -0.0 becomes the +0.0 that the kernel's integer code 0 converts to
    float r = mul_rounded(q, s);
    if (kAffine) r = r + o;
    if (bits_of(r) != bits_of(x[j])) return false;
    codes[j] = static_cast<int16_t>(q);
  }
  return true;
}

static inline bool all_finite(const float* x) {
  for (int64_t j = 0; j < kGroup; ++j)
    if (!std::isfinite(x[j])) return false;
  return true;
}

static bool affine4_group(const float* x, float* scale, float* offset, int16_t* codes) {
  if (!all_finite(x)) return false;
  const float lo = *std::min_element(x, x + kGroup), hi = *std::max_element(x, x + kGroup);
  if (bits_of(to_fp16(lo)) != bits_of(lo)) return false;  // the offset is an fp16 value
  const float estimate = to_fp16((hi - lo) / 15.f);
  for (int steps : kSteps) {
    const float s = fp16_step(estimate, steps);
    if (fits<true>(x, s, lo, 0, 15, codes)) {
      *scale = s;
      *offset = lo;
      return true;
    }
  }
  return false;
}

static bool sym8_group(const float* x, float* scale, int16_t* codes) {
  if (!all_finite(x)) return false;
  float amax = 0.f;
  for (int64_t j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(x[j]));
  for (float d : {127.f, 8.f, 7.f}) {
    const float estimate = to_fp16(amax / d);
    for (int steps : kSteps)
      for (float sign : {1.f, -1.f}) {
        const float s = fp16_step(estimate, steps) * sign;
        if (fits<false>(x, s, 0.f, -127, 127, codes)) {
          *scale = s;
          return true;
        }
      }
  }
  return false;
}

}  // namespace compact_codes

// (kind, scales [N, K/32], offsets [N, K/32] (affine4) or empty, codes int16 [N, K/32, 32]) for an fp32 weight
// [N, K]: kind 1 = affine4, 2 = sym8, 0 = neither form rebuilds every value (the tensors are then empty).
std::tuple<int64_t, torch::Tensor, torch::Tensor, torch::Tensor> find_compact_codes(torch::Tensor weight) {
  using namespace compact_codes;
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat && weight.device().is_cpu(),
              "find_compact_codes: weight must be a 2-D fp32 CPU tensor, got ", weight.sizes(), " ",
              weight.scalar_type());
  TORCH_CHECK(weight.size(1) % kGroup == 0, "find_compact_codes: in_features (", weight.size(1),
              ") must be a multiple of ", kGroup);
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), G = w.size(1) / kGroup;
  const float* x = w.data_ptr<float>();
  auto scales = torch::empty({N, G}, torch::kFloat);
  auto offsets = torch::empty({N, G}, torch::kFloat);
  auto codes = torch::empty({N, G, kGroup}, torch::kShort);
  float* sp = scales.data_ptr<float>();
  float* op = offsets.data_ptr<float>();
  int16_t* cp = codes.data_ptr<int16_t>();
  for (int64_t kind = 1; kind <= 2 && N > 0; ++kind) {
    std::atomic<bool> failed{false};
    at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1 && !failed.load(std::memory_order_relaxed); ++r)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t i = r * G + g;
          const bool ok = kind == 1 ? affine4_group(x + i * kGroup, sp + i, op + i, cp + i * kGroup)
                                    : sym8_group(x + i * kGroup, sp + i, cp + i * kGroup);
          if (!ok) {
            failed.store(true, std::memory_order_relaxed);
            return;
          }
        }
    });
    if (!failed.load()) return {kind, scales, kind == 1 ? offsets : torch::empty({0}), codes};
  }
  return {0, torch::empty({0}), torch::empty({0}), torch::empty({0})};
}
