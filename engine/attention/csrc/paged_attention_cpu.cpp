// Paged decode attention for the CPU: one query token per sequence, K/V read
// straight from the paged cache through the block table (no gather copy).
// One task per sequence; each token row holds all KV heads, so a task streams
// its blocks sequentially. Softmax is exact (two passes over the scores).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <vector>

using Vec = at::vec::Vectorized<float>;

static inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

static inline void axpy(float p, const float* x, float* y, int64_t n) {
  Vec pv(p);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) at::vec::fmadd(pv, Vec::loadu(x + d), Vec::loadu(y + d)).store(y + d);
  for (; d < n; ++d) y[d] += p * x[d];
}

template <typename scalar_t>
static inline const float* row_as_float(const scalar_t* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) { return src; }
  else { for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]); return buf; }
}

using vec_loads::kLanes;

// scores[t] = scale * q . k_t for t in [0, L), four tokens at a time; q is one head (D = NV vectors).
template <int NV>
static void qk_head(const float* q, const float* const* krows, int64_t L, float scale, float* scores) {
  Vec qv[NV];
  VEC_UNROLL
  for (int c = 0; c < NV; ++c) qv[c] = Vec::loadu(q + kLanes * c);
  int64_t t = 0;
  for (; t + 4 <= L; t += 4) {
    Vec a[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
    VEC_UNROLL
    for (int c = 0; c < NV; ++c)
      VEC_UNROLL
      for (int u = 0; u < 4; ++u) a[u] = at::vec::fmadd(qv[c], Vec::loadu(krows[t + u] + kLanes * c), a[u]);
    VEC_UNROLL
    for (int u = 0; u < 4; ++u) scores[t + u] = vec_loads::reduce_add(a[u]) * scale;
  }
  for (; t < L; ++t) {
    Vec a(0.f);
    VEC_UNROLL
    for (int c = 0; c < NV; ++c) a = at::vec::fmadd(qv[c], Vec::loadu(krows[t] + kLanes * c), a);
    scores[t] = vec_loads::reduce_add(a) * scale;
  }
}

// out = sum_t p[t] * v_t, accumulated in registers.
template <int NV>
static void pv_head(const float* p, const float* const* vrows, int64_t L, float* out) {
  Vec acc[NV];
  VEC_UNROLL
  for (int c = 0; c < NV; ++c) acc[c] = Vec(0.f);
  for (int64_t t = 0; t < L; ++t) {
    const Vec pt(p[t]);
    VEC_UNROLL
    for (int c = 0; c < NV; ++c) acc[c] = at::vec::fmadd(pt, Vec::loadu(vrows[t] + kLanes * c), acc[c]);
  }
  VEC_UNROLL
  for (int c = 0; c < NV; ++c) acc[c].store(out + kLanes * c);
}

static void qk_generic(const float* q, const float* const* krows, int64_t L, int64_t D, float scale, float* scores) {
  for (int64_t t = 0; t < L; ++t) scores[t] = dot(q, krows[t], D) * scale;
}

static void pv_generic(const float* p, const float* const* vrows, int64_t L, int64_t D, float* out) {
  std::fill(out, out + D, 0.f);
  for (int64_t t = 0; t < L; ++t) axpy(p[t], vrows[t], out, D);
}

// The G query heads that share KV head kh of sequence b attend over its L rows (krows / vrows,
// D floats each): exact softmax of the scaled scores, then the weighted sum of V into out.
static void attend_heads(const float* qp, float* op, const float* const* krows, const float* const* vrows,
                         float* scores, int64_t b, int64_t kh, int64_t G, int64_t H, int64_t L, int64_t D,
                         float sc) {
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = kh * G + g;
    const float* qh = qp + (b * H + h) * D;
    float* sg = scores + g * L;
    if (D == 64) qk_head<64 / kLanes>(qh, krows, L, sc, sg);
    else if (D == 128) qk_head<128 / kLanes>(qh, krows, L, sc, sg);
    else qk_generic(qh, krows, L, D, sc, sg);
    float m = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, sg, L);
    at::vec::map([m](Vec x) { return (x - Vec(m)).exp_u20(); }, sg, sg, L);
    float sum = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sg, L);
    const float inv = 1.f / sum;
    at::vec::map([inv](Vec x) { return x * Vec(inv); }, sg, sg, L);
    float* oh = op + (b * H + h) * D;
    if (D == 64) pv_head<64 / kLanes>(sg, vrows, L, oh);
    else if (D == 128) pv_head<128 / kLanes>(sg, vrows, L, oh);
    else pv_generic(sg, vrows, L, D, oh);
  }
}

template <typename scalar_t>
void decode_attn_impl(torch::Tensor out, torch::Tensor q, torch::Tensor kv, torch::Tensor block_tables,
                      torch::Tensor seq_lens, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = kv.size(2), KVH = kv.size(3);
  const int64_t G = H / KVH, MB = block_tables.size(1);
  const scalar_t* kbase = kv.data_ptr<scalar_t>();
  const int64_t kv_half = kv.stride(0), blk_stride = kv.stride(1), tok_stride = kv.stride(2), head_stride = kv.stride(3);
  const scalar_t* vbase = kbase + kv_half;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  constexpr bool is_f32 = std::is_same_v<scalar_t, float>;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, conv;
    std::vector<const float*> krows, vrows;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, kh = task % KVH;
      const int64_t L = sl[b];
      scores.resize(G * L);
      krows.resize(L);
      vrows.resize(L);
      // Row pointers for this head once; non-fp32 caches are converted into a scratch copy.
      if constexpr (!is_f32) conv.resize(2 * L * D);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t off = bt[b * MB + t / BS] * blk_stride + (t % BS) * tok_stride + kh * head_stride;
        if constexpr (is_f32) {
          krows[t] = reinterpret_cast<const float*>(kbase + off);
          vrows[t] = reinterpret_cast<const float*>(vbase + off);
        } else {
          float* kc = conv.data() + t * D;
          float* vc = conv.data() + (L + t) * D;
          for (int64_t d = 0; d < D; ++d) { kc[d] = static_cast<float>(kbase[off + d]); vc[d] = static_cast<float>(vbase[off + d]); }
          krows[t] = kc;
          vrows[t] = vc;
        }
      }
      attend_heads(qp, op, krows.data(), vrows.data(), scores.data(), b, kh, G, H, L, D, sc);
    }
  });
}

static inline void prefetch_bytes(const void* p, int64_t bytes, int hint_l2) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) {
    if (hint_l2) _mm_prefetch(c + off, _MM_HINT_T1); else _mm_prefetch(c + off, _MM_HINT_T0);
  }
}

alignas(64) static const float kZeroRow[256] = {};
// Accumulators the register file holds beside a kernel's loads: 24 of AVX-512's 32, 12 of AVX2's 16.
constexpr int kAccumulators = kLanes == 16 ? 24 : 12;

// Where decode_seq reads K and V rows: an fp32 cache is read in place (Fp32Rows); an int8 cache
// (Int8Rows, paged_attention_int8_cpu.cpp) converts up to one block's K rows of one KV head to fp32 in a
// small scratch that stays in L1 and scales the rows' scores, and converts V rows as pass 2 reads them,
// folding each row's scale into its weight. The arithmetic after that is the same code for both.
// V rows for pv_heads, fp32 in place through row pointers; the weights are the probabilities.
struct PtrRows {
  const float* const* ptrs;
  Vec vec(int64_t j, int c) const { return Vec::loadu(ptrs[j] + kLanes * c); }
  float weight(const float* p, int64_t j) const { return p[j]; }
};

struct Fp32Rows {
  static constexpr bool kPrefetchPerRow = true;
  const float* base[2];
  int64_t blk_stride, tok_stride, head_stride, block_bytes;
  int64_t lines() const { return block_bytes / 64; }
  // The first byte of block blk's span (lines() lines), and what else the block needs (nothing here).
  const char* span(int side, int64_t blk) const { return reinterpret_cast<const char*>(base[side] + blk * blk_stride); }
  void prefetch_extra(int, int64_t, int) const {}
  // K: rows[j] = row j0 + j of block blk, KV head kh, for j < m; scratch is unused, and so is row_scale
  // (kRowScales: the rows are the values themselves).
  static constexpr bool kRowScales = false;
  template <int NV>
  void rows(int64_t blk, int64_t j0, int64_t m, int64_t kh, float*, const float** out, float*) const {
    const float* r = base[0] + blk * blk_stride + j0 * tok_stride + kh * head_stride;
    for (int64_t j = 0; j < m; ++j) out[j] = r + j * tok_stride;
  }
  // V: the n rows of block blk, KV head kh, for pv_heads.
  template <int NV>
  PtrRows pass2_rows(int64_t blk, int64_t n, int64_t kh, float*, const float** ptrs) const {
    const float* r = base[1] + blk * blk_stride + kh * head_stride;
    for (int64_t j = 0; j < n; ++j) ptrs[j] = r + j * tok_stride;
    return PtrRows{ptrs};
  }
};

// Where a block's prefetches go out: spread evenly over the row steps of the pass that reads the block
// before, a line or two per step. Pass 1's step r of a block (r = kLanes * (chunk * H + head) + row) sends lines
// [cut[r], cut[r + 1]) of the next K block to L1 and of this V block to L2; pass 2's entries r = head *
// ceil(BS / 2) + row / 2 send lines [cut2[r], cut2[r + 1]) of the next V block to L1 (pv_heads, which takes
// a group's heads together, walks the group's entries HG at a time, one step per pair of rows). A Rows type
// with kPrefetchPerRow false (the int8 cache's, whose blocks are a quarter of the lines) sends each group's
// lines at once, before its rows, and saves the per-step bookkeeping. Spread rather than a KV head's share at
// once, because a burst of misses fills the core's line-fill buffers and the computation's own loads wait
// (figures: docs/perf/engine-notes.md, "Decode attention prefetch").
struct PrefetchPlan {
  std::vector<int64_t> cut, cut2;
  PrefetchPlan(int64_t lines, int64_t BS, int64_t H) {
    const int64_t R = (BS + kLanes - 1) / kLanes * H * kLanes, R2 = H * ((BS + 1) / 2);
    for (int64_t r = 0; r <= R; ++r) cut.push_back(lines * r / R);
    for (int64_t r = 0; r <= R2; ++r) cut2.push_back(lines * r / R2);
  }
};

// Columns [c0, c0 + CV) of pv_heads (below).
template <int NV, int HG, int CV, bool PerRow, typename RowReader>
static inline void pv_heads_cols(const RowReader& rows, const float* p, int64_t Ls, int64_t n, float* out, int c0,
                                 const char* vpf, const int64_t* cut, const char* vpf2) {
  constexpr int64_t D = kLanes * NV;
  vec_loads::Reg acc[HG][CV], acc2[HG][CV];
  VEC_UNROLL
  for (int g = 0; g < HG; ++g)
    VEC_UNROLL
    for (int c = 0; c < CV; ++c) {
      acc[g][c] = Vec::loadu(out + g * D + kLanes * (c0 + c));
      acc2[g][c] = Vec(0.f);
    }
  if (!PerRow && vpf)
    for (int64_t l = cut[0]; l < cut[HG * ((n + 1) / 2)]; ++l) _mm_prefetch(vpf + 64 * l, _MM_HINT_T0);
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    if (PerRow && vpf)
      for (int64_t l = cut[HG * (j / 2)]; l < cut[HG * (j / 2 + 1)]; ++l) {
        _mm_prefetch(vpf + 64 * l, _MM_HINT_T0);
        if (vpf2) _mm_prefetch(vpf2 + 64 * l, _MM_HINT_T1);
      }
    Vec p0[HG], p1[HG];
    VEC_UNROLL
    for (int g = 0; g < HG; ++g) {
      p0[g] = Vec(rows.weight(p + g * Ls, j));
      p1[g] = Vec(rows.weight(p + g * Ls, j + 1));
    }
    VEC_UNROLL
    for (int c = 0; c < CV; ++c) {
      const Vec v0 = rows.vec(j, c0 + c), v1 = rows.vec(j + 1, c0 + c);
      VEC_UNROLL
      for (int g = 0; g < HG; ++g) {
        acc[g][c] = at::vec::fmadd(p0[g], v0, Vec(acc[g][c]));
        acc2[g][c] = at::vec::fmadd(p1[g], v1, Vec(acc2[g][c]));
      }
    }
  }
  if (j < n) {
    VEC_UNROLL
    for (int g = 0; g < HG; ++g) {
      const Vec p0(rows.weight(p + g * Ls, j));
      VEC_UNROLL
      for (int c = 0; c < CV; ++c) acc[g][c] = at::vec::fmadd(p0, rows.vec(j, c0 + c), Vec(acc[g][c]));
    }
  }
  VEC_UNROLL
  for (int g = 0; g < HG; ++g)
    VEC_UNROLL
    for (int c = 0; c < CV; ++c) (Vec(acc[g][c]) + Vec(acc2[g][c])).store(out + g * D + kLanes * (c0 + c));
}

// Pass 2 of decode_seq for HG heads that share a KV head: out[g] += sum_j w(g, j) * row_j over the
// block's n rows, the heads side by side in one pass over the rows. `rows` gives vector c of row j
// (rows.vec(j, c)) and head g's weight for row j (rows.weight(p + g * Ls, j)). Per head the sum is the same
// sequence of FMAs as one head at a time (even rows into one accumulator, odd rows into another, added at the
// end); side by side there are HG times as many independent chains, and each row is read, and each prefetch
// step taken, once rather than once per head. Step s of the rows sends lines [cut[HG * s], cut[HG * (s + 1)])
// of the next V block (vpf) to L1 (PerRow), or all of the group's at the start; with PerRow, the same lines of
// the V block after next (vpf2) go to L2. The columns go CV vectors at a time (CV < NV where the accumulators
// would not fit the registers, AVX2's 16 for head_dim 64 or 128), the prefetches with the first; each element's
// sum is the same either way.
template <int NV, int HG, int CV, bool PerRow, typename RowReader>
static inline void pv_heads(const RowReader& rows, const float* p, int64_t Ls, int64_t n, float* out,
                            const char* vpf, const int64_t* cut, const char* vpf2 = nullptr) {
  static_assert(NV % CV == 0);
  for (int c0 = 0; c0 < NV; c0 += CV)
    pv_heads_cols<NV, HG, CV, PerRow>(rows, p, Ls, n, out, c0, c0 == 0 ? vpf : nullptr, cut, vpf2);
}

// One sequence, all heads (D = kLanes * NV). Pass 1 reads K block by block, contiguously, and writes every
// head's scores, kLanes tokens per reduction (lane_sums); exact softmax per head; pass 2 reads V the same way. Scratch:
// BS * D floats (used by Rows that dequantize), BS + 16 row pointers.
template <int NV, typename Rows>
static void decode_seq(const float* q, float* out, const Rows& src, const int64_t* table, int64_t L, int64_t BS,
                           int64_t H, int64_t KVH, float scale, float* scores, int64_t Ls, float* scratch,
                           const float** ptrs, const PrefetchPlan& plan) {
  const int64_t* cut = plan.cut.data();
  const int64_t* cut2 = plan.cut2.data();
  constexpr int64_t D = kLanes * NV;
  const int64_t G = H / KVH, nblk = (L + BS - 1) / BS;
  const Vec sc(scale);
  for (int64_t i = 0; i < nblk; ++i) {
    const int64_t n = std::min(BS, L - i * BS);
    // Lines of the next K block go to L1, lines of this V block and of the K block after next to L2 (with
    // whatever else the blocks need). Two K blocks ahead: one ahead leaves each thread's KV stream well below
    // the machine's read rate, and three ahead does worse than two (docs/perf/engine-notes.md).
    const char* kpf = i + 1 < nblk ? src.span(0, table[i + 1]) : nullptr;
    const char* vpf = src.span(1, table[i]);
    const char* kpf2 = i + 2 < nblk ? src.span(0, table[i + 2]) : nullptr;
    if (kpf) src.prefetch_extra(0, table[i + 1], 0);
    if (kpf2) src.prefetch_extra(0, table[i + 2], 1);
    src.prefetch_extra(1, table[i], 1);
    for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
      const int64_t m = std::min<int64_t>(kLanes, n - j0);
      for (int64_t kh = 0; kh < KVH; ++kh) {
        const float* rows[kLanes];
        alignas(64) float row_scale[kLanes];
        src.template rows<NV>(table[i], j0, m, kh, scratch, rows, row_scale);
        for (int64_t jj = m; jj < kLanes; ++jj) rows[jj] = kZeroRow;
        Vec score_scale = sc;
        if constexpr (Rows::kRowScales) {
          for (int64_t jj = m; jj < kLanes; ++jj) row_scale[jj] = 0.f;
          score_scale = sc * Vec::loadu(row_scale);
        }
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = kh * G + g;
          const int64_t* c0 = cut + kLanes * ((j0 / kLanes) * H + h);
          vec_loads::Reg qv[NV];
          VEC_UNROLL
          for (int c = 0; c < NV; ++c) qv[c] = Vec::loadu(q + h * D + kLanes * c);
          Vec a[kLanes];  // lane_sums reads them as an array
          if constexpr (!Rows::kPrefetchPerRow)
            for (int64_t l = c0[0]; l < c0[kLanes]; ++l) {
              if (kpf) _mm_prefetch(kpf + 64 * l, _MM_HINT_T0);
              _mm_prefetch(vpf + 64 * l, _MM_HINT_T1);
              if (kpf2) _mm_prefetch(kpf2 + 64 * l, _MM_HINT_T1);
            }
#pragma GCC unroll 16
          for (int jj = 0; jj < kLanes; ++jj) {
            if constexpr (Rows::kPrefetchPerRow)
              for (int64_t l = c0[jj]; l < c0[jj + 1]; ++l) {
                if (kpf) _mm_prefetch(kpf + 64 * l, _MM_HINT_T0);
                _mm_prefetch(vpf + 64 * l, _MM_HINT_T1);
                if (kpf2) _mm_prefetch(kpf2 + 64 * l, _MM_HINT_T1);
              }
            Vec s = Vec(qv[0]) * Vec::loadu(rows[jj]);
            VEC_UNROLL
            for (int c = 1; c < NV; ++c) s = at::vec::fmadd(Vec(qv[c]), Vec::loadu(rows[jj] + kLanes * c), s);
            a[jj] = s;
          }
          (vec_loads::lane_sums(a) * score_scale).store(scores + h * Ls + i * BS + j0);
        }
      }
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    float* sg = scores + h * Ls;
    float mx = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, sg, L);
    at::vec::map([mx](Vec x) { return (x - Vec(mx)).exp_u20(); }, sg, sg, L);
    float sum = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sg, L);
    const float inv = 1.f / sum;
    at::vec::map([inv](Vec x) { return x * Vec(inv); }, sg, sg, L);
  }
  for (int64_t h = 0; h < H; ++h)
    VEC_UNROLL
    for (int c = 0; c < NV; ++c) Vec(0.f).store(out + h * D + kLanes * c);
  const int64_t half = (BS + 1) / 2;
  for (int64_t i = 0; i < nblk; ++i) {
    const int64_t n = std::min(BS, L - i * BS);
    const char* vpf = i + 1 < nblk ? src.span(1, table[i + 1]) : nullptr;
    // Likewise the V block after next to L2 (docs/perf/engine-notes.md).
    const char* vpf2 = i + 2 < nblk ? src.span(1, table[i + 2]) : nullptr;
    for (int64_t kh = 0; kh < KVH; ++kh) {
      const auto rows = src.template pass2_rows<NV>(table[i], n, kh, scratch, ptrs);
      // Heads in groups of up to kAccumulators / (2 * NV) (three for head_dim 64 on AVX-512), each group in one
      // pass over the rows, CV vectors of columns at a time (all of them on AVX-512).
      constexpr int64_t HG = kAccumulators / (2 * NV) > 0 ? kAccumulators / (2 * NV) : 1;
      constexpr int CV = 2 * NV * HG <= kAccumulators ? NV : kAccumulators / 2 >= 4 ? 4 : 2;
      constexpr bool per_row = Rows::kPrefetchPerRow;
      for (int64_t g0 = 0; g0 < G; g0 += HG) {
        const int64_t h0 = kh * G + g0;
        const float* p = scores + h0 * Ls + i * BS;
        float* o = out + h0 * D;
        const int64_t* c0 = cut2 + h0 * half;
        switch (std::min(HG, G - g0)) {
          case 3: pv_heads<NV, 3, CV, per_row>(rows, p, Ls, n, o, vpf, c0, vpf2); break;
          case 2: pv_heads<NV, 2, CV, per_row>(rows, p, Ls, n, o, vpf, c0, vpf2); break;
          default: pv_heads<NV, 1, CV, per_row>(rows, p, Ls, n, o, vpf, c0, vpf2); break;
        }
      }
    }
  }
}

// Every sequence of the batch by decode_seq, one task per sequence; q and out [B, H, D] fp32.
// Threads take sequences longest first from a shared counter. A batch's contexts differ by up to
// tens of times, so a static split of the batch into equal counts can leave one thread with most
// of the KV to read (bench/kernels/decode_attention.py times this against the equal-halves split). A
// sequence's result does not depend on which thread computes it.
template <typename Rows>
static void decode_batch_simd(float* op, const float* qp, const Rows& src, const int64_t* bt, const int64_t* sl,
                                int64_t B, int64_t H, int64_t D, int64_t KVH, int64_t BS, int64_t MB, float sc) {
  std::vector<int64_t> order(B);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [sl](int64_t a, int64_t b) { return sl[a] > sl[b]; });
  std::atomic<int64_t> next{0};
  const PrefetchPlan plan(src.lines(), BS, H);
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), B));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scores, scratch(BS * D);
    std::vector<const float*> ptrs(BS + 16);
    for (;;) {
      const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= B) break;
      const int64_t b = order[i];
      const int64_t L = sl[b];
      if (L <= 0) {
        std::fill(op + b * H * D, op + (b + 1) * H * D, 0.f);
        continue;
      }
      const int64_t Ls = ((L + BS - 1) / BS) * BS + 16;
      scores.resize(H * Ls);
      if (D == 64)
        decode_seq<64 / kLanes>(qp + b * H * D, op + b * H * D, src, bt + b * MB, L, BS, H, KVH, sc, scores.data(), Ls,
                          scratch.data(), ptrs.data(), plan);
      else
        decode_seq<128 / kLanes>(qp + b * H * D, op + b * H * D, src, bt + b * MB, L, BS, H, KVH, sc, scores.data(), Ls,
                          scratch.data(), ptrs.data(), plan);
    }
  });
}

static void decode_attn_simd(torch::Tensor out, torch::Tensor q, torch::Tensor kv, torch::Tensor block_tables,
                               torch::Tensor seq_lens, double scale) {
  const float* kbase = kv.data_ptr<float>();
  const Fp32Rows src{{kbase, kbase + kv.stride(0)}, kv.stride(1), kv.stride(2), kv.stride(3),
                     kv.size(2) * kv.stride(2) * static_cast<int64_t>(sizeof(float))};
  decode_batch_simd(out.data_ptr<float>(), q.data_ptr<float>(), src, block_tables.data_ptr<int64_t>(),
                      seq_lens.data_ptr<int64_t>(), q.size(0), q.size(1), q.size(2), kv.size(3), kv.size(2),
                      block_tables.size(1), static_cast<float>(scale));
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale) {
  auto qf = q.to(torch::kFloat).contiguous();
  auto out = torch::empty_like(qf);
  const int64_t D = qf.size(2), KVH = kv.size(3);
  if (vec_loads::kSimd && kv.scalar_type() == torch::kFloat && (D == 64 || D == 128) && kv.stride(3) == D && kv.stride(2) == KVH * D &&
      kv.stride(1) == kv.size(2) * KVH * D && qf.size(1) % KVH == 0) {
    decode_attn_simd(out, qf, kv, block_tables.contiguous(), seq_lens.contiguous(), scale);
    return out.to(q.scalar_type());
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv.scalar_type(), "paged_decode_attention", [&] {
    decode_attn_impl<scalar_t>(out, qf, kv, block_tables.contiguous(), seq_lens.contiguous(), scale);
  });
  return out.to(q.scalar_type());
}

// Skinny GEMM for small decode batches: y[m, n] = sum_k x[m, k] * w[n, k].
// BLAS picks poor paths for 1-8 rows; this streams each weight row once at
// full memory bandwidth and reuses it from L1 for every input row.
template <int M>
static void skinny_rows(const float* x, const float* w, float* y, int64_t n0, int64_t n1, int64_t K, int64_t N,
                        const float* bias) {
  constexpr int64_t V = Vec::size();
  constexpr int U = M <= 2 ? 4 : (M <= 4 ? 2 : 1);  // independent chains per row, to hide FMA latency
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    Vec acc[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = Vec(0.f);
    int64_t k = 0;
    for (; k + U * V <= K; k += U * V) {
      for (int u = 0; u < U; ++u) {
        Vec wv = Vec::loadu(wr + k + u * V);
        for (int m = 0; m < M; ++m) acc[m][u] = at::vec::fmadd(Vec::loadu(x + m * K + k + u * V), wv, acc[m][u]);
      }
    }
    for (; k + V <= K; k += V) {
      Vec wv = Vec::loadu(wr + k);
      for (int m = 0; m < M; ++m) acc[m][0] = at::vec::fmadd(Vec::loadu(x + m * K + k), wv, acc[m][0]);
    }
    for (int m = 0; m < M; ++m) {
      Vec total = acc[m][0];
      for (int u = 1; u < U; ++u) total = total + acc[m][u];
      float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, total);
      for (int64_t kk = k; kk < K; ++kk) s += x[m * K + kk] * wr[kk];
      y[m * N + n] = s + (bias ? bias[n] : 0.f);
    }
  }
}

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "skinny_linear is fp32 only");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  TORCH_CHECK(M >= 1 && M <= 8, "skinny_linear takes 1 to 8 rows");
  auto y = torch::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: skinny_rows<1>(xp, wp, yp, n0, n1, K, N, bp); break;
      case 2: skinny_rows<2>(xp, wp, yp, n0, n1, K, N, bp); break;
      case 3: skinny_rows<3>(xp, wp, yp, n0, n1, K, N, bp); break;
      case 4: skinny_rows<4>(xp, wp, yp, n0, n1, K, N, bp); break;
      case 5: skinny_rows<5>(xp, wp, yp, n0, n1, K, N, bp); break;
      case 6: skinny_rows<6>(xp, wp, yp, n0, n1, K, N, bp); break;
      case 7: skinny_rows<7>(xp, wp, yp, n0, n1, K, N, bp); break;
      default: skinny_rows<8>(xp, wp, yp, n0, n1, K, N, bp); break;
    }
  });
  return y;
}

// Batch-invariant linear: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) where every
// output element is computed by the same sequence of operations (one FMA chain
// over K in fixed 8-float chunks, the same horizontal sum, then the tail), so a
// row's result never depends on how many rows share the call or how they are
// tiled. The 4x2 register tile only decides which elements run side by side.
static inline float hsum_vec(Vec v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

static inline float invariant_dot_tail(const float* x, const float* w, int64_t k0, int64_t K, float s) {
  for (int64_t k = k0; k < K; ++k) s += x[k] * w[k];
  return s;
}

template <int MR, int NR>
static inline void invariant_tile(const float* x, const float* w, float* y, int64_t m0, int64_t n0, int64_t K,
                                  int64_t N, const float* bias) {
  constexpr int64_t V = Vec::size();
  Vec acc[MR][NR];
  VEC_UNROLL
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = Vec(0.f);
  int64_t k = 0;
  for (; k + V <= K; k += V) {
    Vec wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = Vec::loadu(w + (n0 + j) * K + k);
    VEC_UNROLL
    for (int i = 0; i < MR; ++i) {
      Vec xv = Vec::loadu(x + (m0 + i) * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = at::vec::fmadd(xv, wv[j], acc[i][j]);
    }
  }
  VEC_UNROLL
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = invariant_dot_tail(x + (m0 + i) * K, w + (n0 + j) * K, k, K, hsum_vec(acc[i][j]));
      y[(m0 + i) * N + n0 + j] = s + (bias ? bias[n0 + j] : 0.f);
    }
}

torch::Tensor invariant_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "invariant_linear is fp32 only");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto y = torch::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  constexpr int64_t NB = 32;  // weight rows per task: ~72 KB of a 576-wide layer, kept in L2 for all rows of x
  constexpr int64_t MB = 64;  // rows of x per pass over a weight block
  at::parallel_for(0, (N + NB - 1) / NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb) {
      const int64_t n_begin = nb * NB, n_end = std::min(N, n_begin + NB);
      for (int64_t m_begin = 0; m_begin < M; m_begin += MB) {
        const int64_t m_end = std::min(M, m_begin + MB);
        int64_t n = n_begin;
        for (; n + 2 <= n_end; n += 2) {
          int64_t m = m_begin;
          for (; m + 4 <= m_end; m += 4) invariant_tile<4, 2>(xp, wp, yp, m, n, K, N, bp);
          for (; m < m_end; ++m) invariant_tile<1, 2>(xp, wp, yp, m, n, K, N, bp);
        }
        for (; n < n_end; ++n) {
          int64_t m = m_begin;
          for (; m + 4 <= m_end; m += 4) invariant_tile<4, 1>(xp, wp, yp, m, n, K, N, bp);
          for (; m < m_end; ++m) invariant_tile<1, 1>(xp, wp, yp, m, n, K, N, bp);
        }
      }
    }
  });
  return y;
}
