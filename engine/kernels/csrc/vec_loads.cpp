// Loads every kernel shares, on ATen's portable vectors (at::vec::Vectorized<float>: 16 lanes where the module is
// built for AVX-512, 8 for AVX2 and for the scalar baseline; engine/kernels/cpu_build.py builds one module per
// instruction set from these same sources and loads the one the host takes). Compiled first in the translation unit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <xmmintrin.h>  // _mm_prefetch: SSE, on every x86-64 CPU

namespace vec_loads {

using FVec = at::vec::Vectorized<float>;
constexpr int kLanes = FVec::size();

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
constexpr bool kSimd = true;
#else
constexpr bool kSimd = false;
#endif

// kLanes int8 (kSigned) or uint8 values from p as floats (exact).
template <bool kSigned>
static inline FVec bytes_to_float(const void* p) {
  if constexpr (kSimd) {
    using Byte = std::conditional_t<kSigned, int8_t, uint8_t>;
    return at::vec::convert_int8_to_float<Byte>(at::vec::Vectorized<Byte>::loadu_one_fourth(p));
  } else {
    alignas(64) float tmp[kLanes];
    for (int i = 0; i < kLanes; ++i)
      tmp[i] = kSigned ? static_cast<float>(static_cast<const int8_t*>(p)[i])
                       : static_cast<float>(static_cast<const uint8_t*>(p)[i]);
    return FVec::loadu(tmp);
  }
}

// kLanes fp16 values from p (any alignment) as floats (exact).
static inline FVec halves_to_float(const void* p) {
  FVec out;
  at::vec::load_to_float<at::Half>(static_cast<const at::Half*>(p), out);
  return out;
}

// The first `n` of kLanes floats (0 <= n <= kLanes), the rest zero; full vectors take the plain load.
static inline FVec load_first(const float* p, int64_t n) {
  return n >= kLanes ? FVec::loadu(p) : (n <= 0 ? FVec(0.f) : FVec::loadu(p, n));
}
static inline void store_first(const FVec& v, float* p, int64_t n) {
  if (n >= kLanes) v.store(p);
  else if (n > 0) v.store(p, n);
}

static inline float reduce_add(const FVec& v) {
  return at::vec::vec_reduce_all<float>([](FVec& a, FVec& b) { return a + b; }, v);
}

}  // namespace vec_loads

// Floats per at::vec vector in this module: 16 (AVX-512) or 8 (AVX2, baseline). Tests check which module they hold.
int64_t vector_lanes() { return vec_loads::kLanes; }
