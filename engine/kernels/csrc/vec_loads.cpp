// Loads every kernel shares, on ATen's portable vectors (at::vec::Vectorized<float>: 16 lanes where the module is
// built for AVX-512, 8 for AVX2 and for the scalar baseline; engine/kernels/cpu_build.py builds one module per
// instruction set from these same sources and loads the one the host takes). Compiled first in the translation unit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <xmmintrin.h>  // _mm_prefetch: SSE, on every x86-64 CPU

// NOTE: put before every loop over an array of vectors (accumulators, a row's vectors) in a kernel: GCC keeps such
// an array in registers only where every loop that indexes it is unrolled in full, else the FMA chains go through
// the stack (several times slower at few rows).
#define VEC_UNROLL _Pragma("GCC unroll 32")

namespace vec_loads {

using FVec = at::vec::Vectorized<float>;
constexpr int kLanes = FVec::size();

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
constexpr bool kSimd = true;
#else
constexpr bool kSimd = false;
#endif

// NOTE: arrays of accumulators in the kernels' hot loops hold the vector's register type (Reg), not FVec, and
// convert at each use (free): with FVec elements GCC keeps such an array in memory wherever the loop also has a
// branch (a prefetch), and every FMA chain then goes through the stack.
#if defined(CPU_CAPABILITY_AVX512)
using Reg = __m512;
#elif defined(CPU_CAPABILITY_AVX2)
using Reg = __m256;
#else
using Reg = FVec;
#endif

// kLanes int8 (kSigned) or uint8 values from p as floats (exact).
template <bool kSigned>
static inline FVec bytes_to_float(const void* p) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  using Byte = std::conditional_t<kSigned, int8_t, uint8_t>;
  return at::vec::convert_int8_to_float<Byte>(at::vec::Vectorized<Byte>::loadu_one_fourth(p));
#else
  alignas(64) float tmp[kLanes];
  for (int i = 0; i < kLanes; ++i)
    tmp[i] = kSigned ? static_cast<float>(static_cast<const int8_t*>(p)[i])
                     : static_cast<float>(static_cast<const uint8_t*>(p)[i]);
  return FVec::loadu(tmp);
#endif
}

// kLanes fp16 values from p (any alignment) as floats (exact).
static inline FVec halves_to_float(const void* p) {
  FVec out;
  at::vec::load_to_float<at::Half>(static_cast<const at::Half*>(p), out);
  return out;
}

// The two 4-bit codes of kLanes bytes at p as floats: the low nibbles in lo, the high ones in hi (the exact values
// 0.0 .. 15.0 either way). AVX-512 permutes from a table 0.0 .. 15.0, which reads only an index's low 4 bits (the
// AND and the conversion in one op); elsewhere hi = floor(byte / 16) and lo = byte - 16 hi, exact in fp32.
static inline void nibble_floats(const uint8_t* p, FVec& lo, FVec& hi) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 table = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
  lo = _mm512_permutexvar_ps(v, table);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
#else
  const FVec byte = bytes_to_float<false>(p);
  hi = (byte * FVec(0.0625f)).floor();
  lo = byte - hi * FVec(16.f);
#endif
}

// kLanes vectors -> one vector of their lane sums (lane j = the sum of v[j]'s lanes), by a transpose-add tree: the
// one reduction at::vec lacks (it sums one vector at a time).
static inline FVec lane_sums(const FVec* v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 a[8], c[4];
  for (int i = 0; i < 8; ++i) {
    const __m512 x = v[2 * i], y = v[2 * i + 1];
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 4; ++i) {
    __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  __m512 d = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  __m512 e = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d, e, 0x88), _mm512_shuffle_f32x4(d, e, 0xDD));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
#else
  alignas(64) float sums[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    alignas(64) float lanes[kLanes];
    v[j].store(lanes);
    sums[j] = 0.f;
    for (int i = 0; i < kLanes; ++i) sums[j] += lanes[i];
  }
  return FVec::loadu(sums);
#endif
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
