// Causal prefill attention for the CPU over a paged cache, fp32 or int8 (cache_bits 8): one chunk
// of one sequence's queries (rows num_cached .. num_cached + T - 1 of the sequence) attends to the
// sequence's rows [0, own row], read in place through the block table (the chunk's own K/V are
// already written). Int8 rows are dequantized as each key chunk is copied into scratch.
//
// Compiled in one translation unit after paged_attention_cpu.cpp (it uses its Vec alias).
// Layout: a vector's lanes are R = Vec::size() consecutive query rows. A task takes one KV head and
// R query rows of each of the G query heads that share it; it keeps Q transposed (qT[g][d] = the
// R rows' d-th elements, pre-scaled) and the output transposed (oT[g][d]), and walks the keys R at
// a time:
//   scores  sT[j] = sum_d K[j][d] * qT[d]        (R keys, one FMA per key and d, no reductions)
//   softmax online per lane: m, l and the rescale alpha are vectors over the R rows
//   output  oT[d] = alpha * oT[d] + sum_j V[j][d] * pT[j]
// so both products are broadcast-FMA loops and the softmax never reduces across lanes. Key
// chunks past a tile's last row are skipped (causal), the diagonal ones masked. Tasks are dealt
// out round-robin, longest first, so that both halves of a causal chunk weigh the same.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

namespace prefill_attn {

constexpr int64_t R = Vec::size();  // query rows per task = keys per chunk
constexpr int64_t DU = R >= 16 ? 8 : 4;  // independent output rows per pass (register budget)

struct Args {
  const float* q;  // [T, H, D], row stride q_row
  float* out;      // [T, H, D] contiguous
  const float* kbase;  // fp32 cache, or null for an int8 one
  const float* vbase;
  const int64_t* table;
  int64_t T, H, KVH, D, BS, q_row, blk_stride, tok_stride, num_cached;
  float scale;
  // int8 cache (cache_bits 8): codes with the fp32 cache's strides, one fp16 scale per (row, KV head).
  const int8_t* k8 = nullptr;
  const int8_t* v8 = nullptr;
  const at::Half* ks = nullptr;
  const at::Half* vs = nullptr;
  int64_t s_blk_stride = 0, s_tok_stride = 0;
};

// Row k of KV head kh into dst (D floats): copied, or dequantized as code * scale (exact in fp32,
// the same values as kv_int8.dequantize_rows).
static inline void load_row(const Args& a, int side, int64_t k, int64_t kh, int64_t D, float* dst) {
  const int64_t blk = a.table[k / a.BS], row = k % a.BS;
  const int64_t off = blk * a.blk_stride + row * a.tok_stride + kh * D;
  if (a.kbase) {
    const float* src = (side ? a.vbase : a.kbase) + off;
    std::copy(src, src + D, dst);
    return;
  }
  const int8_t* src = (side ? a.v8 : a.k8) + off;
  const float sc = static_cast<float>((side ? a.vs : a.ks)[blk * a.s_blk_stride + row * a.s_tok_stride + kh]);
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * sc;
}

// One task: KV head kh, query rows [r0, r0 + R) of the chunk (rows past T computed, not stored).
// DC is head_dim when known at compile time (64, 128: the offsets into the key chunk become
// constants), else 0. Each key chunk is first copied into kc / vc ([R][D], zeros past the
// tile's last key), so that every product reads one dense array.
template <int64_t DC>
static void tile(const Args& a, int64_t kh, int64_t r0, float* qT, float* oT, float* pT, float* mv, float* lv,
                 float* kc, float* vc) {
  const int64_t G = a.H / a.KVH, D = DC ? DC : a.D;
  const int64_t rows = std::min(R, a.T - r0);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = kh * G + g;
    for (int64_t d = 0; d < D; ++d) {
      float* dst = qT + (g * D + d) * R;
      for (int64_t r = 0; r < R; ++r) dst[r] = r < rows ? a.q[(r0 + r) * a.q_row + h * D + d] * a.scale : 0.f;
    }
    std::fill(oT + g * D * R, oT + (g + 1) * D * R, 0.f);
    Vec(-std::numeric_limits<float>::infinity()).store(mv + g * R);
    Vec(0.f).store(lv + g * R);
  }
  const Vec pos = Vec::arange(static_cast<float>(a.num_cached + r0), 1.f);  // each lane's row
  const Vec neg_inf(-std::numeric_limits<float>::infinity());
  const int64_t kv_hi = a.num_cached + r0 + rows;  // keys this tile's stored rows can see
  for (int64_t j0 = 0; j0 < kv_hi; j0 += R) {
    for (int64_t j = 0; j < R; ++j) {
      const int64_t k = j0 + j;
      if (k < kv_hi) {
        load_row(a, 0, k, kh, D, kc + j * D);
        load_row(a, 1, k, kh, D, vc + j * D);
      } else {  // never seen (masked), but must be finite
        std::fill(kc + j * D, kc + (j + 1) * D, 0.f);
        std::fill(vc + j * D, vc + (j + 1) * D, 0.f);
      }
    }
    const bool diagonal = j0 + R - 1 > a.num_cached + r0;
    for (int64_t g = 0; g < G; ++g) {
      Vec s[R];
#pragma GCC unroll 16
      for (int64_t j = 0; j < R; ++j) s[j] = Vec(0.f);
      const float* qg = qT + g * D * R;
      for (int64_t d = 0; d < D; ++d) {
        const Vec qd = Vec::loadu(qg + d * R);
        const float* kd = kc + d;
#pragma GCC unroll 16
        for (int64_t j = 0; j < R; ++j) s[j] = at::vec::fmadd(Vec(kd[j * D]), qd, s[j]);
      }
      if (diagonal) {
#pragma GCC unroll 16
        for (int64_t j = 0; j < R; ++j) s[j] = Vec::blendv(s[j], neg_inf, pos < Vec(static_cast<float>(j0 + j)));
      }
      Vec mx = s[0];
#pragma GCC unroll 16
      for (int64_t j = 1; j < R; ++j) mx = at::vec::maximum(mx, s[j]);
      const Vec m_old = Vec::loadu(mv + g * R);
      const Vec m_new = at::vec::maximum(m_old, mx);  // finite: every row sees key 0 in the first chunk
      const Vec alpha = (m_old - m_new).exp_u20();
      Vec lsum(0.f);
#pragma GCC unroll 16
      for (int64_t j = 0; j < R; ++j) {
        const Vec p = (s[j] - m_new).exp_u20();
        p.store(pT + j * R);
        lsum = lsum + p;
      }
      m_new.store(mv + g * R);
      (Vec::loadu(lv + g * R) * alpha + lsum).store(lv + g * R);
      float* og = oT + g * D * R;
      int64_t d = 0;
      for (; d + DU <= D; d += DU) {
        Vec o[DU];
#pragma GCC unroll 8
        for (int64_t u = 0; u < DU; ++u) o[u] = Vec::loadu(og + (d + u) * R) * alpha;
        const float* vd = vc + d;
#pragma GCC unroll 16
        for (int64_t j = 0; j < R; ++j) {
          const Vec p = Vec::loadu(pT + j * R);
#pragma GCC unroll 8
          for (int64_t u = 0; u < DU; ++u) o[u] = at::vec::fmadd(Vec(vd[j * D + u]), p, o[u]);
        }
#pragma GCC unroll 8
        for (int64_t u = 0; u < DU; ++u) o[u].store(og + (d + u) * R);
      }
      for (; d < D; ++d) {
        Vec o = Vec::loadu(og + d * R) * alpha;
        for (int64_t j = 0; j < R; ++j) o = at::vec::fmadd(Vec(vc[j * D + d]), Vec::loadu(pT + j * R), o);
        o.store(og + d * R);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = kh * G + g;
    const float* l = lv + g * R;
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = a.out + ((r0 + r) * a.H + h) * D;
      const float inv = 1.f / l[r];
      for (int64_t d = 0; d < D; ++d) dst[d] = oT[(g * D + d) * R + r] * inv;
    }
  }
}

}  // namespace prefill_attn

// Both entry points: checks common to the cache types, then tasks dealt out to the threads.
static void check_prefill_args(const torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& kv,
                               const torch::Tensor& block_table, int64_t num_cached) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && kv.dim() == 5 && block_table.dim() == 1,
              "paged_prefill_attention: q/out [T, H, D], kv [2, blocks, BS, KVH, D], block_table [n]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && out.scalar_type() == torch::kFloat &&
                  block_table.scalar_type() == torch::kLong,
              "paged_prefill_attention: fp32 q and out, int64 block table");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), BS = kv.size(2), KVH = kv.size(3);
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(), "paged_prefill_attention: out must be a contiguous [T, H, D]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, "paged_prefill_attention: q's heads must be dense");
  TORCH_CHECK(kv.size(0) == 2 && kv.size(4) == D && kv.stride(4) == 1 && kv.stride(3) == D,
              "paged_prefill_attention: cache rows must be dense [2, blocks, BS, KVH, D]");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "paged_prefill_attention: heads must be a multiple of KV heads");
  TORCH_CHECK(D > 0 && D <= 512, "paged_prefill_attention: head_dim must be in [1, 512]");
  TORCH_CHECK(num_cached >= 0 && block_table.is_contiguous() && block_table.numel() * BS >= num_cached + T,
              "paged_prefill_attention: the block table must cover num_cached + T rows");
  // Row positions are compared as floats in the causal mask: exact below 2^24.
  TORCH_CHECK(num_cached + T < (int64_t{1} << 24), "paged_prefill_attention: sequences must be under 2^24 rows");
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t used = (num_cached + T + BS - 1) / BS;
  for (int64_t i = 0; i < used; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < kv.size(1), "paged_prefill_attention: block id out of range");
}

static void run_prefill(const prefill_attn::Args& a) {
  const int64_t R = prefill_attn::R, G = a.H / a.KVH, D = a.D;
  const int64_t tiles = (a.T + R - 1) / R, tasks = tiles * a.KVH;
  const int64_t P = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
  at::parallel_for(0, P, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qT(G * D * R), oT(G * D * R), pT(R * R), mv(G * R), lv(G * R), kc(R * D), vc(R * D);
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = t; i < tasks; i += P) {  // longest (last) tiles first, dealt round-robin
        const int64_t r0 = (tiles - 1 - i / a.KVH) * R, kh = i % a.KVH;
        float* s[] = {qT.data(), oT.data(), pT.data(), mv.data(), lv.data(), kc.data(), vc.data()};
        if (D == 64) prefill_attn::tile<64>(a, kh, r0, s[0], s[1], s[2], s[3], s[4], s[5], s[6]);
        else if (D == 128) prefill_attn::tile<128>(a, kh, r0, s[0], s[1], s[2], s[3], s[4], s[5], s[6]);
        else prefill_attn::tile<0>(a, kh, r0, s[0], s[1], s[2], s[3], s[4], s[5], s[6]);
      }
  });
}

// out[T, H, D] (contiguous, written) = causal attention of q[T, H, D] (rows may be strided) for
// rows num_cached .. num_cached + T - 1 of one sequence over its rows in the fp32 paged cache
// kv[2, blocks, BS, KVH, D] through block_table.
void paged_prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv, torch::Tensor block_table,
                             int64_t num_cached, double scale) {
  check_prefill_args(out, q, kv, block_table, num_cached);
  TORCH_CHECK(kv.scalar_type() == torch::kFloat, "paged_prefill_attention: fp32 cache (int8: paged_prefill_attention_int8)");
  if (q.size(0) == 0) return;
  const float* kbase = kv.data_ptr<float>();
  run_prefill({q.data_ptr<float>(), out.data_ptr<float>(), kbase, kbase + kv.stride(0),
               block_table.data_ptr<int64_t>(), q.size(0), q.size(1), kv.size(3), q.size(2), kv.size(2), q.stride(0),
               kv.stride(1), kv.stride(2), num_cached, static_cast<float>(scale)});
}

// The same over an int8 cache: codes [2, blocks, BS, KVH, D], scales [2, blocks, BS, KVH] fp16.
void paged_prefill_attention_int8(torch::Tensor out, torch::Tensor q, torch::Tensor values, torch::Tensor scales,
                                  torch::Tensor block_table, int64_t num_cached, double scale) {
  check_prefill_args(out, q, values, block_table, num_cached);
  TORCH_CHECK(values.scalar_type() == torch::kChar && scales.scalar_type() == torch::kHalf,
              "paged_prefill_attention_int8: int8 codes and fp16 scales");
  TORCH_CHECK(scales.dim() == 4 && scales.size(0) == 2 && scales.size(1) == values.size(1) &&
                  scales.size(2) == values.size(2) && scales.size(3) == values.size(3) && scales.stride(3) == 1,
              "paged_prefill_attention_int8: scales must be [2, blocks, BS, KVH] with dense heads");
  if (q.size(0) == 0) return;
  prefill_attn::Args a{q.data_ptr<float>(), out.data_ptr<float>(), nullptr, nullptr, block_table.data_ptr<int64_t>(),
                       q.size(0), q.size(1), values.size(3), q.size(2), values.size(2), q.stride(0),
                       values.stride(1), values.stride(2), num_cached, static_cast<float>(scale)};
  const int8_t* vb = values.data_ptr<int8_t>();
  const at::Half* sb = scales.data_ptr<at::Half>();
  a.k8 = vb;
  a.v8 = vb + values.stride(0);
  a.ks = sb;
  a.vs = sb + scales.stride(0);
  a.s_blk_stride = scales.stride(1);
  a.s_tok_stride = scales.stride(2);
  run_prefill(a);
}
