// Linear layers for 1-256 rows (decode batches and short prefill chunks) on x86 CPUs with AVX2 or AVX-512 (one
// source on at::vec, built once per instruction set: engine/kernels/cpu_build.py):
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) over a weight packed once into panels of 32
// output columns, each panel's K x 32 floats contiguous (pack_panels).
//
// Why: oneDNN and MKL run these row counts at a fraction of the machine's GEMM rate. Per panel
// a task computes every row of x against it in register tiles (AVX-512: up to 12 rows x 32 columns; AVX2: up
// to 6 rows x 16 columns, two passes a panel); the panel is read once from memory and then from L2, and while a panel is
// computed the next one is prefetched into L2, spread over the tiles' K steps, so the weight
// stream overlaps the arithmetic. Measured in bench/kernels/panel_gemm.py.
//
// Every output element is one FMA chain over k = 0..K-1 in order, then + bias: a row's result
// does not depend on how many rows share the call, how they are tiled or which thread runs them.
//
// A weight may also come as compact panels (uint8, see rebuild_panel below): exact 4-bit or 8-bit codes
// with fp16 scales, from which the kernel rebuilds the same fp32 values, so the results are bitwise those
// of the fp32 panels while a call reads a sixth or a quarter of the bytes.

#include <array>
#include <cstdlib>
#include <memory>
#include <utility>

namespace panel_gemm {

using vec_loads::FVec;
using vec_loads::kLanes;
using vec_loads::Reg;
// NOTE: the packed layouts are the same on every instruction set: a panel is 32 columns, 2 vectors of AVX-512 or 4
// of AVX2, so a weight packed on one host is read bit for bit alike by the other's module.
constexpr int64_t kCols = 32;
constexpr int kPanelVecs = kCols / kLanes;
// A tile computes 2 vectors of a panel's columns (the whole panel on AVX-512, half of it on AVX2, in two passes over
// K) for up to kMaxTileRows rows: 24 or 12 accumulators, what 32 zmm or 16 ymm registers hold beside the loads.
constexpr int kTileVecs = 2;
constexpr int kTilePasses = kPanelVecs / kTileVecs;
constexpr int kMaxTileRows = kLanes == 16 ? 12 : 6;
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
// Where a tile takes two passes (AVX2), each pass sends its half of the lines.
template <int MR, int PF>
static void tile_pass(const float* a, int64_t lda, const float* panel, int64_t K, float* c, int64_t ldc,
                      const float* bias, int64_t cols, const char* prefetch, int64_t lines) {
  Reg acc[MR][kTileVecs];
  VEC_UNROLL
  for (int i = 0; i < MR; ++i)
    VEC_UNROLL
    for (int v = 0; v < kTileVecs; ++v) acc[i][v] = FVec(0.f);
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
    FVec b[kTileVecs];
    VEC_UNROLL
    for (int v = 0; v < kTileVecs; ++v) b[v] = FVec::loadu(panel + k * kCols + v * kLanes);
    VEC_UNROLL
    for (int i = 0; i < MR; ++i) {
      const FVec av(a[i * lda + k]);
      VEC_UNROLL
      for (int v = 0; v < kTileVecs; ++v) acc[i][v] = at::vec::fmadd(av, b[v], FVec(acc[i][v]));
    }
  }
  VEC_UNROLL
  for (int v = 0; v < kTileVecs; ++v) {
    const int64_t n = cols - v * kLanes;
    const FVec bv = bias ? vec_loads::load_first(bias + v * kLanes, n) : FVec(0.f);
VEC_UNROLL
    for (int i = 0; i < MR; ++i) vec_loads::store_first(FVec(acc[i][v]) + bv, c + i * ldc + v * kLanes, n);
  }
}

// Rows [0, MR) of x against one panel (its first `cols` columns stored), in kTilePasses passes of kTileVecs vectors.
template <int MR, int PF>
static void tile(const float* a, int64_t lda, const float* panel, int64_t K, float* c, int64_t ldc, const float* bias,
                 int64_t cols, const char* prefetch, int64_t lines) {
  constexpr int64_t kPassCols = kTileVecs * kLanes;
  int64_t sent = 0;
  for (int pass = 0; pass < kTilePasses; ++pass) {
    const int64_t share = (lines - sent) / (kTilePasses - pass);
    tile_pass<MR, PF>(a, lda, panel + pass * kPassCols, K, c + pass * kPassCols, ldc,
                      bias ? bias + pass * kPassCols : nullptr, cols - pass * kPassCols,
                      prefetch ? prefetch + 64 * sent : nullptr, share);
    sent += share;
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, const float*, int64_t,
                        const char*, int64_t);
// Page heads serve only calls of fewer than page_head_rows() (at most 8) rows.
template <int R, int PF>
constexpr TileFn tile_fn() {
  if constexpr (R == 0 || (PF == kPageHeads && R > 7)) return nullptr;
  else return tile<R, PF>;
}
template <int PF, int... R>
constexpr std::array<TileFn, sizeof...(R)> tile_row(std::integer_sequence<int, R...>) {
  return {tile_fn<R, PF>()...};
}
// [PF][rows]
static constexpr std::array<std::array<TileFn, kMaxTileRows + 1>, 4> kTiles = {
    tile_row<0>(std::make_integer_sequence<int, kMaxTileRows + 1>{}),
    tile_row<1>(std::make_integer_sequence<int, kMaxTileRows + 1>{}),
    tile_row<2>(std::make_integer_sequence<int, kMaxTileRows + 1>{}),
    tile_row<kPageHeads>(std::make_integer_sequence<int, kMaxTileRows + 1>{})};

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

// NOTE: the module is built with -ffp-contract=off (cpu_build.py), so a product stays a rounded product: no
// compiler fuses it with a following add into an FMA, on either instruction set. Every FMA here is written out.
static inline FVec mul_rn(const FVec& a, const FVec& b) { return a * b; }
// fl(fl(code * scale) + offset), GGUF's Q4_1 dequantization, in one instruction: a 4-bit code (0-15) times an fp16
// scale has at most 15 significant bits, so the product is exact in fp32 and its rounding changes nothing; an FMA's
// one rounding of code * scale + offset is then the add's, signed zeros included (IEEE 754's rules for a sum).
// One vector op fewer per vector of values than a multiply and an add; bitwise the same
// (tests/unit/test_compact_weights.py).
static inline FVec affine4_value(const FVec& code, const FVec& scale, const FVec& offset) {
  return at::vec::fmadd(code, scale, offset);
}
using vec_loads::nibble_floats;

// One K step of a compact panel's block as kPanelVecs vectors of 32 fp32 weights: affine4 from the step's 16 code
// bytes (byte j: column j low, column j + 16 high), sym8 from its 32 int8 codes; s and o are the block's scales and
// offsets as vectors.
template <bool kAffine>
static inline void rebuild_step(const uint8_t* blk, int64_t k, const FVec* s, const FVec* o, FVec* w) {
  if constexpr (kAffine) {
    constexpr int kHalf = kPanelVecs / 2;  // vectors of columns 0-15 (low nibbles), then 16-31 (high)
    VEC_UNROLL
    for (int v = 0; v < kHalf; ++v) {
      FVec lo, hi;
      nibble_floats(blk + 128 + 16 * k + v * kLanes, lo, hi);
      w[v] = affine4_value(lo, s[v], o[v]);
      w[v + kHalf] = affine4_value(hi, s[v + kHalf], o[v + kHalf]);
    }
  } else {
    VEC_UNROLL
    for (int v = 0; v < kPanelVecs; ++v)
      w[v] = mul_rn(vec_loads::bytes_to_float<true>(blk + 64 + 32 * k + v * kLanes), s[v]);
  }
}

// A block's scales (and offsets), one vector per kLanes columns.
template <bool kAffine>
static inline void block_scales(const uint8_t* blk, FVec* s, FVec* o) {
  VEC_UNROLL
  for (int v = 0; v < kPanelVecs; ++v) {
    s[v] = vec_loads::halves_to_float(blk + 2 * kLanes * v);
    if constexpr (kAffine) o[v] = vec_loads::halves_to_float(blk + 64 + 2 * kLanes * v);
  }
}

// One panel's K x 32 fp32 values (groups x 32 steps) into `out`.
static void rebuild_panel(const uint8_t* src, int64_t groups, int64_t block, float* out) {
  for (int64_t g = 0; g < groups; ++g, src += block, out += kGroup * kCols) {
    FVec s[kPanelVecs], o[kPanelVecs], w[kPanelVecs];
    if (block == kAffine4Block) {
      block_scales<true>(src, s, o);
      for (int64_t k = 0; k < kGroup; ++k) {
        rebuild_step<true>(src, k, s, o, w);
        VEC_UNROLL
        for (int v = 0; v < kPanelVecs; ++v) w[v].store(out + k * kCols + v * kLanes);
      }
    } else {
      block_scales<false>(src, s, o);
      for (int64_t k = 0; k < kGroup; ++k) {
        rebuild_step<false>(src, k, s, o, w);
        VEC_UNROLL
        for (int v = 0; v < kPanelVecs; ++v) w[v].store(out + k * kCols + v * kLanes);
      }
    }
  }
}

// Up to kFusedMaxRows rows of x run straight from the codes: NP panels side by side, each step's 32 values of
// each panel rebuilt in registers (the same arithmetic as rebuild_panel) and used at once. Each output is
// still one FMA chain over k in order from zero, then + bias, so results are the fp32 panels' bitwise. Why:
// with so few rows a tile's accumulator chains leave the FMA units waiting on their latency, and
// rebuilding through the scratch costs a store and a load per value; NP panels give NP times the chains.
// Each panel's block two groups ahead is prefetched as a group starts.
// The accumulators (NP x rows x kPanelVecs) stay within 24 on AVX-512's 32 registers and 12 on AVX2's 16.
constexpr int kFusedMaxRows = kLanes == 16 ? 12 : 3;

template <int MR, int NP, bool kAffine>
static void fused_rows(const float* a, int64_t lda, const uint8_t* src, int64_t panel_bytes, int64_t groups, float* c,
                       int64_t ldc, const float* bias, int64_t cols) {
  constexpr int64_t block = kAffine ? kAffine4Block : kSym8Block;
  Reg acc[NP][MR][kPanelVecs];
  VEC_UNROLL
  for (int j = 0; j < NP; ++j)
    VEC_UNROLL
    for (int i = 0; i < MR; ++i)
      VEC_UNROLL
      for (int v = 0; v < kPanelVecs; ++v) acc[j][i][v] = FVec(0.f);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk[NP];
    FVec s[NP][kPanelVecs], o[NP][kPanelVecs];
    VEC_UNROLL
    for (int j = 0; j < NP; ++j) {
      blk[j] = src + j * panel_bytes + g * block;
      block_scales<kAffine>(blk[j], s[j], o[j]);
      if (g + 2 < groups)
        for (int64_t line = 0; line < block; line += 64) _mm_prefetch(reinterpret_cast<const char*>(blk[j]) + 2 * block + line, _MM_HINT_T0);
    }
    const float* ag = a + g * kGroup;
    for (int64_t k = 0; k < kGroup; ++k) {
      VEC_UNROLL
      for (int j = 0; j < NP; ++j) {
        FVec w[kPanelVecs];
        rebuild_step<kAffine>(blk[j], k, s[j], o[j], w);
        VEC_UNROLL
        for (int i = 0; i < MR; ++i) {
          const FVec av(ag[i * lda + k]);
          VEC_UNROLL
          for (int v = 0; v < kPanelVecs; ++v) acc[j][i][v] = at::vec::fmadd(av, w[v], FVec(acc[j][i][v]));
        }
      }
    }
  }
VEC_UNROLL
  for (int j = 0; j < NP; ++j) {
    const float* bj = bias ? bias + j * kCols : nullptr;
VEC_UNROLL
    for (int v = 0; v < kPanelVecs; ++v) {
      const int64_t n = cols - j * kCols - v * kLanes;
      const FVec b = bj ? vec_loads::load_first(bj + v * kLanes, n) : FVec(0.f);
VEC_UNROLL
      for (int i = 0; i < MR; ++i) vec_loads::store_first(FVec(acc[j][i][v]) + b, c + i * ldc + j * kCols + v * kLanes, n);
    }
  }
}

using FusedFn = void (*)(const float*, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t, const float*,
                         int64_t);

// Panels side by side for `rows` rows, as the registers allow: on AVX-512 up to 4 for one row, 2 for 2-4 rows, else
// 1; on AVX2 2 for one row, else 1.
constexpr int fused_width(int rows) {
  return kLanes == 16 ? (rows == 1 ? 4 : (rows <= 4 ? 2 : 1)) : (rows == 1 ? 2 : 1);
}
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

torch::Tensor unpack_compact_panels(torch::Tensor packed, int64_t out_features) {
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
}

// Rows `ids` of the weight that compact panels hold, [ids, K] fp32: the token embeddings of a tied table whose
// fp32 copy was freed. Each value is rebuilt with rebuild_panel's roundings (the same bits).
torch::Tensor compact_rows(torch::Tensor packed, torch::Tensor ids, int64_t out_features) {
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
    alignas(64) float codes[kGroup];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t col = id[i] % kCols;
      const uint8_t* blk = base + (id[i] / kCols) * G * block;
      for (int64_t g = 0; g < G; ++g, blk += block) {
        const auto* halves = reinterpret_cast<const at::Half*>(blk);
        const FVec s(static_cast<float>(halves[col]));
        const FVec o(affine ? static_cast<float>(halves[kCols + col]) : 0.f);
        for (int64_t k = 0; k < kGroup; ++k) {
          if (affine) {
            const uint8_t byte = blk[128 + 16 * k + col % 16];
            codes[k] = col < 16 ? (byte & 0xF) : (byte >> 4);
          } else {
            codes[k] = static_cast<int8_t>(blk[64 + 32 * k + col]);
          }
        }
        float* row = dst + i * K + g * kGroup;
        for (int64_t h = 0; h < kGroup; h += kLanes) {
          const FVec q = FVec::loadu(codes + h);
          (affine ? affine4_value(q, s, o) : mul_rn(q, s)).store(row + h);
        }
      }
    }
  });
  return out;
}

// The panel kernels run in every module; they are the fast path (and the engine packs panels) where the module is
// built for AVX2 or AVX-512, not on the scalar baseline.
bool panel_gemm_available() { return vec_loads::kSimd; }

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
  // Rows split into equal tiles of at most kMaxTileRows (50 rows on AVX-512: five of 10, not four of 12 and one of 2).
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
        fn(xp + m * lda, lda, panel, K, yp + m * N + p * kCols, N, bp ? bp + p * kCols : nullptr, cols, ahead,
           lines);
      }
    }
  });
  return y;
}
