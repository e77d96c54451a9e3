// Linear layers for 1-256 rows (decode batches and short prefill chunks) on AVX-512 CPUs:
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) over a weight packed once into panels of 32
// output columns, each panel's K x 32 floats contiguous (pack_panels).
//
// Why: oneDNN and MKL run these row counts at a fraction of the machine's GEMM rate. Per panel
// a task computes every row of x against it in register tiles of up to 12 rows x 32 columns
// (24 accumulators); the panel is read once from memory and then from L2, and while a panel is
// computed the next one is prefetched into L2, spread over the tiles' K steps, so the weight
// stream overlaps the arithmetic. Measured in bench/kernels/panel_gemm.py.
//
// Every output element is one FMA chain over k = 0..K-1 in order, then + bias: a row's result
// does not depend on how many rows share the call, how they are tiled or which thread runs them.
//
// A weight may also come as compact panels (uint8, see rebuild_panel below): exact 4-bit or 8-bit codes
// with fp16 scales, from which the kernel rebuilds the same fp32 values, so the results are bitwise those
// of the fp32 panels while a call reads a sixth or a quarter of the bytes.

#if defined(__AVX512F__)
#include <immintrin.h>
#include <array>
#include <cstdlib>
#include <memory>
#include <utility>

namespace panel_gemm {

constexpr int64_t kCols = 32;
constexpr int kMaxTileRows = 12;
// Calls with fewer rows prefetch page heads (tile's PF = kPageHeads) rather than the next panel: 8 on AMD CPUs,
// 2 (single rows only) on the others: page heads beat the next panel's spread prefetch for few rows on AMD
// CPUs and lose from 2 rows up on Intel ones (docs/perf/engine-notes.md, "Panel GEMM page heads").
static int64_t page_head_rows() {
  static const int64_t rows = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") ? 8 : 2;
  }();
  return rows;
}
constexpr int kPageHeads = 3;
// How far ahead of a tile's loads the page heads go (4 pages of 4 KiB).
constexpr int64_t kPageHeadAhead = 16384;

// PF = kPageHeads (calls of fewer than page_head_rows() rows): the tile sends `prefetch` nothing, and instead, each
// time its loads are kPageHeadAhead bytes short of a 4 KiB boundary, the first two lines past that boundary to L2.
// Such a call is bound by the weight stream alone (a K step is a few cycles), and each thread reads one
// contiguous run of panels: the hardware prefetcher carries the stream within a page but does not cross into
// the next 4 KiB page, and two lines there restart it early. In huge pages, leaving the tile no prefetch at all
// does about as well as page heads (docs/perf/engine-notes.md).
// Otherwise the tile sends the first `lines` lines from `prefetch` to L2: PF = 1 or 2 a K step from k = 0
// (lines <= PF * K); PF = 0 spreads fewer lines than steps evenly over the steps, one every K / lines (16.16 fixed point).
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
  const int64_t steps = PF == 1 || PF == 2 ? lines / PF : 0;
  const int64_t gap = PF == 0 && lines > 0 ? (K << 16) / lines : 0;
  int64_t issued = 0, next = PF == 0 && lines > 0 ? 0 : K;
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(panel) + kPageHeadAhead;
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (PF == kPageHeads) {
      const uintptr_t at = ahead + 4 * kCols * k;  // a step reads 128 bytes: one step a page lands here
      if ((at & 4095) < 4 * kCols) {
        const char* head = reinterpret_cast<const char*>(at & ~uintptr_t{4095});
        _mm_prefetch(head, _MM_HINT_T1);
        _mm_prefetch(head + 64, _MM_HINT_T1);
      }
    }
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
static const TileFn kTiles[4][kMaxTileRows + 1] = {
    {nullptr, tile<1, 0>, tile<2, 0>, tile<3, 0>, tile<4, 0>, tile<5, 0>, tile<6, 0>, tile<7, 0>, tile<8, 0>,
     tile<9, 0>, tile<10, 0>, tile<11, 0>, tile<12, 0>},
    {nullptr, tile<1, 1>, tile<2, 1>, tile<3, 1>, tile<4, 1>, tile<5, 1>, tile<6, 1>, tile<7, 1>, tile<8, 1>,
     tile<9, 1>, tile<10, 1>, tile<11, 1>, tile<12, 1>},
    {nullptr, tile<1, 2>, tile<2, 2>, tile<3, 2>, tile<4, 2>, tile<5, 2>, tile<6, 2>, tile<7, 2>, tile<8, 2>,
     tile<9, 2>, tile<10, 2>, tile<11, 2>, tile<12, 2>},
    {nullptr, tile<1, kPageHeads>, tile<2, kPageHeads>, tile<3, kPageHeads>, tile<4, kPageHeads>, tile<5, kPageHeads>,
     tile<6, kPageHeads>, tile<7, kPageHeads>, nullptr, nullptr, nullptr, nullptr, nullptr}};

static inline __mmask16 lanes(int64_t n) { return n >= 16 ? 0xFFFF : (n <= 0 ? 0 : (__mmask16)((1u << n) - 1)); }

// Compact panels (engine/models/compact_weights.py packs them): where a weight's fp32 values are exactly
// small integer codes times fp16 scales (plus fp16 offsets), as a GGUF Q4_0, Q4_1 or Q8_0 import's are,
// each panel holds, per group of 32 K steps, a block of
//   affine4 (640 bytes):  32 fp16 scales, 32 fp16 offsets, then per step 16 bytes: column j's 4-bit code
//                         in the low nibble of byte j, column j + 16's in the high nibble;
//                         w = fl(fl(code * scale) + offset), as gguf's Q4_1 dequantize computes it;
//   sym8 (1088 bytes):    32 fp16 scales, then per step 32 int8 codes; w = fl(code * scale) (Q8_0, Q4_0).
// A panel is rebuilt into an L1/L2 scratch before its tiles run, so the tiles, and every result, are the
// fp32 panels' bitwise; the packer checks that the rebuilt values equal the weight's, bit for bit, or keeps
// fp32. A decode step then streams 16% (affine4) or 27% (sym8) of the fp32 panels' bytes.
constexpr int64_t kGroup = 32;
constexpr int64_t kAffine4Block = 64 + 64 + kGroup * 16;
constexpr int64_t kSym8Block = 64 + kGroup * 32;

// The _round variant is not contracted into an FMA by the compiler: the multiply rounds on its own.
static inline __m512 mul_rn(__m512 a, __m512 b) {
  return _mm512_mul_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// fl(fl(code * scale) + offset), GGUF's Q4_1 dequantization, in one instruction: a 4-bit code (0-15) times an fp16
// scale has at most 15 significant bits, so the product is exact in fp32 and its rounding changes nothing; an FMA's
// one rounding of code * scale + offset is then the add's, signed zeros included (IEEE 754's rules for a sum).
// One vector op fewer per 16 values than a multiply and an add; bitwise the same (tests/unit/test_compact_weights.py).
static inline __m512 affine4_value(__m512 code, __m512 scale, __m512 offset) {
  return _mm512_fmadd_ps(code, scale, offset);
}
// The two 4-bit codes of each of 16 bytes (zero-extended to 32-bit lanes in v) as floats: the low nibble (column j)
// in lo, the high one (column j + 16) in hi. A permute from the table 0.0 .. 15.0 reads only an index's low 4 bits,
// so it is the AND and the conversion in one op (the same values).
static inline void nibble_floats(__m512i v, __m512& lo, __m512& hi) {
  const __m512 table = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
  lo = _mm512_permutexvar_ps(v, table);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}
static inline __m512 half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(p)));
}

// One panel's K x 32 fp32 values (groups x 32 steps) into `out`, 64-byte aligned.
static void rebuild_panel(const uint8_t* src, int64_t groups, int64_t block, float* out) {
  for (int64_t g = 0; g < groups; ++g, src += block, out += kGroup * kCols) {
    const __m512 s0 = half16(src), s1 = half16(src + 32);
    if (block == kAffine4Block) {
      const __m512 o0 = half16(src + 64), o1 = half16(src + 96);
      const uint8_t* codes = src + 128;
      for (int64_t k = 0; k < kGroup; ++k) {
        __m512 q0, q1;
        nibble_floats(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(codes + 16 * k))), q0, q1);
        _mm512_store_ps(out + k * kCols, affine4_value(q0, s0, o0));
        _mm512_store_ps(out + k * kCols + 16, affine4_value(q1, s1, o1));
      }
    } else {
      const uint8_t* codes = src + 64;
      for (int64_t k = 0; k < kGroup; ++k) {
        const __m512i v0 = _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(codes + 32 * k)));
        const __m512i v1 = _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(codes + 32 * k + 16)));
        _mm512_store_ps(out + k * kCols, mul_rn(_mm512_cvtepi32_ps(v0), s0));
        _mm512_store_ps(out + k * kCols + 16, mul_rn(_mm512_cvtepi32_ps(v1), s1));
      }
    }
  }
}

// Up to kFusedMaxRows rows of x run straight from the codes: NP panels side by side, each step's 32 values of
// each panel rebuilt in registers (the same arithmetic as rebuild_panel) and used at once. Each output is
// still one FMA chain over k in order from zero, then + bias, so results are the fp32 panels' bitwise. Why:
// with so few rows a tile's 2 x MR accumulator chains leave the FMA units waiting on their latency, and
// rebuilding through the scratch costs a store and a load per value; NP panels give 2 x MR x NP chains.
// Each panel's block two groups ahead is prefetched as a group starts.
constexpr int kFusedMaxRows = 12;

template <bool kAffine>
static inline void rebuild_step(const uint8_t* blk, int64_t k, const __m512 s[2], const __m512 o[2], __m512& w0,
                                __m512& w1) {
  if constexpr (kAffine) {
    __m512 q0, q1;
    nibble_floats(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(blk + 128 + 16 * k))), q0, q1);
    w0 = affine4_value(q0, s[0], o[0]);
    w1 = affine4_value(q1, s[1], o[1]);
  } else {
    const uint8_t* codes = blk + 64 + 32 * k;
    w0 = mul_rn(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(codes)))), s[0]);
    w1 = mul_rn(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(codes + 16)))),
                s[1]);
  }
}

template <int MR, int NP, bool kAffine>
static void fused_rows(const float* a, int64_t lda, const uint8_t* src, int64_t panel_bytes, int64_t groups, float* c,
                       int64_t ldc, const float* bias, int64_t cols) {
  constexpr int64_t block = kAffine ? kAffine4Block : kSym8Block;
  __m512 acc[NP][MR][2];
  for (int j = 0; j < NP; ++j)
    for (int i = 0; i < MR; ++i) acc[j][i][0] = acc[j][i][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk[NP];
    __m512 s[NP][2], o[NP][2];
    for (int j = 0; j < NP; ++j) {
      blk[j] = src + j * panel_bytes + g * block;
      s[j][0] = half16(blk[j]);
      s[j][1] = half16(blk[j] + 32);
      if constexpr (kAffine) {
        o[j][0] = half16(blk[j] + 64);
        o[j][1] = half16(blk[j] + 96);
      }
      if (g + 2 < groups)
        for (int64_t line = 0; line < block; line += 64) _mm_prefetch(reinterpret_cast<const char*>(blk[j]) + 2 * block + line, _MM_HINT_T0);
    }
    const float* ag = a + g * kGroup;
    for (int64_t k = 0; k < kGroup; ++k) {
      for (int j = 0; j < NP; ++j) {
        __m512 w0, w1;
        rebuild_step<kAffine>(blk[j], k, s[j], o[j], w0, w1);
        for (int i = 0; i < MR; ++i) {
          const __m512 av = _mm512_set1_ps(ag[i * lda + k]);
          acc[j][i][0] = _mm512_fmadd_ps(av, w0, acc[j][i][0]);
          acc[j][i][1] = _mm512_fmadd_ps(av, w1, acc[j][i][1]);
        }
      }
    }
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t left = cols - j * kCols;
    const __mmask16 m0 = lanes(left), m1 = lanes(left - 16);
    const float* bj = bias ? bias + j * kCols : nullptr;
    const __m512 b0 = bj ? _mm512_maskz_loadu_ps(m0, bj) : _mm512_setzero_ps();
    const __m512 b1 = bj ? _mm512_maskz_loadu_ps(m1, bj + 16) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) {
      _mm512_mask_storeu_ps(c + i * ldc + j * kCols, m0, _mm512_add_ps(acc[j][i][0], b0));
      _mm512_mask_storeu_ps(c + i * ldc + j * kCols + 16, m1, _mm512_add_ps(acc[j][i][1], b1));
    }
  }
}

using FusedFn = void (*)(const float*, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t, const float*,
                         int64_t);

// Panels side by side for `rows` rows: up to 4 for one row, 2 for 2-4 rows, else 1 (the registers allow no more).
constexpr int fused_width(int rows) { return rows == 1 ? 4 : (rows <= 4 ? 2 : 1); }
constexpr int kMaxFusedWidth = 4;

// fused_rows<R, NP> where NP panels side by side fit R rows' registers, else nullptr (not instantiated).
template <int R, int NP, bool kAffine>
constexpr FusedFn fused_fn() {
  if constexpr (NP <= fused_width(R)) return fused_rows<R, NP, kAffine>;
  else return nullptr;
}

template <bool kAffine, int... R>
constexpr std::array<std::array<FusedFn, kMaxFusedWidth + 1>, sizeof...(R) + 1> fused_table(
    std::integer_sequence<int, R...>) {
  return {{{},
           {nullptr, fused_fn<R + 1, 1, kAffine>(), fused_fn<R + 1, 2, kAffine>(), fused_fn<R + 1, 3, kAffine>(),
            fused_fn<R + 1, 4, kAffine>()}...}};
}

// [affine][rows][panels side by side].
static constexpr std::array<std::array<FusedFn, kMaxFusedWidth + 1>, kFusedMaxRows + 1> kFused[2] = {
    fused_table<false>(std::make_integer_sequence<int, kFusedMaxRows>{}),
    fused_table<true>(std::make_integer_sequence<int, kFusedMaxRows>{})};

// How many of P panels a fused run takes side by side for `rows` rows over `threads` threads: the runs are shared
// out in contiguous equal counts (at::parallel_for), so the width is the one, up to fused_width(rows), that leaves
// the busiest thread the fewest panels, the widest of those (more independent FMA chains). SmolLM2's o_proj and
// down_proj have 18 panels: four wide that is five runs, three on one thread of two (12 panels against 6); three
// wide it is six runs, nine panels each. Every output is the same FMA chain whatever the width. Faster than a
// fixed width of 4 (2) at 1-4 rows (docs/perf/engine-notes.md, "Fused run width").
static int fused_run_width(int64_t rows, int64_t P, int64_t threads) {
  const int widest = fused_width(static_cast<int>(rows));
  int best = widest;
  int64_t fewest = P + 1;
  for (int w = widest; w >= 1; --w) {
    const int64_t runs = (P + w - 1) / w, per_thread = (runs + threads - 1) / threads;
    const int64_t busiest = std::min<int64_t>(per_thread * w, P);
    if (busiest < fewest) {
      fewest = busiest;
      best = w;
    }
  }
  return best;
}

// A thread's scratch for one rebuilt panel, grown as needed and kept for the thread's life.
static float* panel_scratch(int64_t floats) {
  thread_local std::unique_ptr<float, decltype(&std::free)> buffer(nullptr, &std::free);
  thread_local int64_t capacity = 0;
  if (floats > capacity) {
    const size_t bytes = static_cast<size_t>((floats * 4 + 63) / 64 * 64);
    buffer.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
    TORCH_CHECK(buffer, "panel_linear: cannot allocate ", bytes, " bytes of scratch");
    capacity = floats;
  }
  return buffer.get();
}

// Checks a compact panel tensor [P, K / 32, block] and returns its block size.
static int64_t compact_block(const torch::Tensor& packed);

// Checks `packed` (compact, uint8) as `fn`'s argument holding `out_features` rows; returns its block size.
static int64_t checked_compact(const torch::Tensor& packed, int64_t out_features, const char* fn) {
  TORCH_CHECK(packed.scalar_type() == torch::kByte, fn, " takes a compact (uint8) packed weight");
  const int64_t block = compact_block(packed), P = packed.size(0);
  TORCH_CHECK(out_features > (P - 1) * kCols && out_features <= P * kCols, fn, ": out_features ", out_features,
              " does not match ", P, " panels");
  return block;
}

static int64_t compact_block(const torch::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() &&
                  (packed.size(2) == kAffine4Block || packed.size(2) == kSym8Block),
              "panel_linear: a compact packed weight must be contiguous uint8 [panels, in_features / 32, ",
              kAffine4Block, " or ", kSym8Block, "]");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr<uint8_t>()) % 64 == 0,
              "panel_linear: compact packed weight not aligned");
  return packed.size(2);
}

}  // namespace panel_gemm
#endif

torch::Tensor unpack_compact_panels(torch::Tensor packed, int64_t out_features) {
#if defined(__AVX512F__)
  using namespace panel_gemm;
  const int64_t block = checked_compact(packed, out_features, "unpack_compact_panels");
  const int64_t P = packed.size(0), G = packed.size(1), K = G * kGroup;
  auto panels = torch::empty({P, K, kCols}, torch::kFloat);
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* dst = panels.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) rebuild_panel(src + p * G * block, G, block, dst + p * K * kCols);
  });
  // [P, K, 32] -> [P * 32, K], the padding columns dropped.
  return panels.transpose(1, 2).reshape({P * kCols, K}).narrow(0, 0, out_features).contiguous();
#else
  TORCH_CHECK(false, "unpack_compact_panels needs AVX-512");
  return packed;
#endif
}

// Rows `ids` of the weight that compact panels hold, [ids, K] fp32: the token embeddings of a tied table whose
// fp32 copy was freed. Each value is rebuilt with rebuild_panel's roundings (the same bits).
torch::Tensor compact_rows(torch::Tensor packed, torch::Tensor ids, int64_t out_features) {
#if defined(__AVX512F__)
  using namespace panel_gemm;
  const int64_t block = checked_compact(packed, out_features, "compact_rows");
  const int64_t G = packed.size(1), K = G * kGroup;
  auto idx = ids.to(torch::kLong).contiguous().view(-1);
  const int64_t n = idx.numel();
  const int64_t* id = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < out_features, "compact_rows: row ", id[i], " outside [0, ", out_features, ")");
  auto out = torch::empty({n, K}, torch::kFloat);
  float* dst = out.data_ptr<float>();
  const uint8_t* base = packed.data_ptr<uint8_t>();
  const bool affine = block == kAffine4Block;
  at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    alignas(64) int32_t codes[kGroup];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t col = id[i] % kCols;
      const uint8_t* blk = base + (id[i] / kCols) * G * block;
      for (int64_t g = 0; g < G; ++g, blk += block) {
        const auto* halves = reinterpret_cast<const at::Half*>(blk);
        const __m512 s = _mm512_set1_ps(static_cast<float>(halves[col]));
        const __m512 o = _mm512_set1_ps(affine ? static_cast<float>(halves[kCols + col]) : 0.f);
        for (int64_t k = 0; k < kGroup; ++k) {
          if (affine) {
            const uint8_t byte = blk[128 + 16 * k + col % 16];
            codes[k] = col < 16 ? (byte & 0xF) : (byte >> 4);
          } else {
            codes[k] = static_cast<int8_t>(blk[64 + 32 * k + col]);
          }
        }
        float* row = dst + i * K + g * kGroup;
        for (int64_t h = 0; h < kGroup; h += 16) {
          const __m512 q = _mm512_cvtepi32_ps(_mm512_load_si512(codes + h));
          _mm512_storeu_ps(row + h, affine ? affine4_value(q, s, o) : mul_rn(q, s));
        }
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "compact_rows needs AVX-512");
  return packed;
#endif
}

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
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "panel_linear takes fp32 x [rows, in_features]");
  const bool compact = packed.scalar_type() == torch::kByte;
  const int64_t block = compact ? compact_block(packed) : 0;
  TORCH_CHECK(compact || (packed.scalar_type() == torch::kFloat && packed.dim() == 3 && packed.size(2) == kCols &&
                          packed.is_contiguous()),
              "panel_linear needs a weight from pack_panels or compact_weights.pack_compact");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), N = out_features;
  const int64_t packed_k = compact ? packed.size(1) * kGroup : packed.size(1);
  TORCH_CHECK(packed_k == K, "panel_linear: x has ", K, " features, the packed weight ", packed_k);
  TORCH_CHECK(N > (P - 1) * kCols && N <= P * kCols, "panel_linear: out_features ", N, " does not match the packing");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == torch::kFloat),
              "panel_linear: bias must be ", N, " contiguous fp32 values");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0, "panel_linear: packed weight not aligned");
  // Rows may be strided (a column slice of a wider tensor, like the gate half of gate_up): no copy.
  auto xc = x.stride(1) == 1 && x.stride(0) >= K ? x : x.contiguous();
  const int64_t lda = xc.stride(0);
  auto y = torch::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const char* wp = static_cast<const char*>(packed.data_ptr());
  const int64_t panel_bytes = compact ? packed.size(1) * block : K * kCols * 4;
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Rows split into equal tiles of at most 12 (50 rows: five of 10, not four of 12 and one of 2).
  const int64_t ntiles = (M + kMaxTileRows - 1) / kMaxTileRows, per = (M + ntiles - 1) / ntiles;
  // From page_head_rows() rows up (and for compact panels), each tile prefetches its share of the next panel
  // into L2, spread over its K steps: one line per step,
  // or two where a single tile holds every row from 4 rows up (the panel's lines are 2 x K, so one line
  // per step would leave half of it to the hardware prefetcher). Below 4 rows a step is too short for two.
  // From 3 tiles up a share is fewer lines than steps, and goes out evenly over all of them (tile<.., 0>),
  // faster than one a step from k = 0 and bitwise the same (docs/perf/engine-notes.md).
  // `.venv/bin/python -m bench.kernels.panel_gemm --base REV` times this against an earlier commit's kernel.
  // Below page_head_rows() rows, fp32 panels' tiles send page heads instead (tile<.., kPageHeads>, which says why).
  const bool page_heads = !compact && M < page_head_rows();
  const int64_t panel_lines = page_heads ? 0 : panel_bytes / 64;
  const int64_t pf = ntiles == 1 && M >= 4 ? 2 : 1;
  const int64_t share = std::min((panel_lines + ntiles - 1) / ntiles, pf * K);  // lines per tile
  // A compact panel is rebuilt into the thread's scratch first (rebuild_panel); the tiles then prefetch the
  // next compact panel, a sixth or a quarter of the lines of an fp32 one.
  if (compact && M <= kFusedMaxRows) {
    const bool affine = block == kAffine4Block;
    const int64_t wide = fused_run_width(M, P, at::get_num_threads());
    const int64_t units = (P + wide - 1) / wide;  // runs of `wide` panels, the last maybe shorter
    at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t first = u * wide, last = std::min(P, first + wide);
        const auto* src = reinterpret_cast<const uint8_t*>(wp);
        if (last - first == wide) {
          kFused[affine][M][wide](xp, lda, src + first * panel_bytes, panel_bytes, K / kGroup, yp + first * kCols, N,
                                  bp ? bp + first * kCols : nullptr, N - first * kCols);
        } else {
          for (int64_t p = first; p < last; ++p)
            kFused[affine][M][1](xp, lda, src + p * panel_bytes, panel_bytes, K / kGroup, yp + p * kCols, N,
                                 bp ? bp + p * kCols : nullptr, N - p * kCols);
        }
      }
    });
    return y;
  }
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    float* scratch = compact ? panel_scratch(K * kCols) : nullptr;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = std::min<int64_t>(kCols, N - p * kCols);
      const __mmask16 m0 = lanes(cols), m1 = lanes(cols - 16);
      const char* src = wp + p * panel_bytes;
      const float* panel = reinterpret_cast<const float*>(src);
      if (compact) {
        rebuild_panel(reinterpret_cast<const uint8_t*>(src), K / kGroup, block, scratch);
        panel = scratch;
      }
      const char* next = p + 1 < p1 ? src + panel_bytes : nullptr;
      int64_t t = 0;
      for (int64_t m = 0; m < M; m += per, ++t) {
        const int64_t rows = std::min(per, M - m);
        int64_t lines = 0;
        const char* ahead = nullptr;
        if (next) {
          ahead = next + 64 * t * share;
          lines = std::max<int64_t>(0, std::min(share, panel_lines - t * share));
        }
        const TileFn fn = kTiles[page_heads ? kPageHeads : (lines < pf * K ? 0 : pf)][rows];
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
