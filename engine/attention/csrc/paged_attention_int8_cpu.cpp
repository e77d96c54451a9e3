// Paged decode attention over an int8 KV cache (cache_bits: 8).
//
// Compiled in one translation unit after paged_attention_cpu.cpp, whose per-head score and
// weighted-sum helpers (qk_head, pv_head, qk_generic, pv_generic) it reuses. K/V rows are int8 with
// one fp16 scale per (token, kv head); each task dequantizes its head's rows into a scratch copy
// (value * scale, as the torch reference computes it) and runs the fp32 helpers on that.
// Dynamic precision: rows at or after `ring_lo[b]` are read at full precision from the
// sequence's ring of recent rows (ring[slot, row % W]) instead of the int8 pool.
// On AVX2 and AVX-512 CPUs, without a ring, head_dim 64 or 128: the fp32 kernel's sequence-per-task path
// (decode_seq) reads the int8 rows, a quarter of the fp32 bytes. It applies the scales to what
// the codes produce rather than to every value: s * (q . code) for a score, (p * s) * code in the
// weighted sum of V. That is the same value as the reference's up to rounding (the tests compare
// within 1e-5) and saves a multiply per value, where this path's time goes: it is bound by its
// arithmetic, not by memory.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <vector>

static inline void dequant_row(const int8_t* q, float s, float* out, int64_t D) {
  int64_t d = 0;
  const Vec sv(s);
  for (; d + kLanes <= D; d += kLanes) (vec_loads::bytes_to_float<true>(q + d) * sv).store(out + d);
  for (; d < D; ++d) out[d] = static_cast<float>(q[d]) * s;
}

// V rows of one KV head of one block as int8 codes, for pv_heads: a row is converted to fp32 as it is read
// (exact, |code| <= 127) and its scale goes into the weight, p * scale, instead of into every value.
struct Int8PassRows {
  const int8_t* codes;  // row 0 of the block, this KV head
  const at::Half* scale;
  int64_t step, scale_step;  // codes / scales between consecutive rows
  Vec vec(int64_t j, int c) const { return vec_loads::bytes_to_float<true>(codes + j * step + kLanes * c); }
  float weight(const float* p, int64_t j) const { return p[j] * static_cast<float>(scale[j * scale_step]); }
};

struct Int8Rows {
  static constexpr bool kPrefetchPerRow = false;  // a block is a quarter of the lines: a group's at once
  static constexpr bool kRowScales = true;
  const int8_t* base[2];
  const at::Half* scales[2];
  int64_t BS, KVH, D, block_bytes;
  int64_t lines() const { return block_bytes / 64; }
  const char* span(int side, int64_t blk) const { return reinterpret_cast<const char*>(base[side] + blk * BS * KVH * D); }
  // A block's fp16 scales, beside its codes.
  void prefetch_extra(int side, int64_t blk, int hint_l2) const {
    prefetch_bytes(scales[side] + blk * BS * KVH, BS * KVH * 2, hint_l2);
  }
  // K: rows j0 .. j0 + m - 1 of block blk, KV head kh, converted to fp32 into the scratch (L1), unscaled;
  // row_scale[j] is row j's scale, which pass 1 applies to the row's scores (q . (code * s) = s * (q . code)).
  template <int NV>
  void rows(int64_t blk, int64_t j0, int64_t m, int64_t kh, float* scratch, const float** out,
            float* row_scale) const {
    constexpr int64_t Dc = kLanes * NV;
    const int64_t r0 = (blk * BS + j0) * KVH + kh;
    const int8_t* codes = base[0] + r0 * Dc;
    const at::Half* sc = scales[0] + r0;
    const int64_t step = KVH * Dc;
    for (int64_t j = 0; j < m; ++j, codes += step) {
      row_scale[j] = static_cast<float>(sc[j * KVH]);
      float* dst = scratch + j * Dc;
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c)
        vec_loads::bytes_to_float<true>(codes + kLanes * c).store(dst + kLanes * c);
      out[j] = dst;
    }
  }
  template <int NV>
  Int8PassRows pass2_rows(int64_t blk, int64_t, int64_t kh, float*, const float**) const {
    const int64_t r0 = blk * BS * KVH + kh;
    return Int8PassRows{base[1] + r0 * kLanes * NV, scales[1] + r0, KVH * kLanes * NV, KVH};
  }
};

torch::Tensor paged_decode_attention_int8(torch::Tensor q, torch::Tensor kv, torch::Tensor kv_scales,
                                          torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                          c10::optional<torch::Tensor> ring, c10::optional<torch::Tensor> ring_slots,
                                          c10::optional<torch::Tensor> ring_lo) {
  TORCH_CHECK(kv.scalar_type() == torch::kChar && kv.dim() == 5, "kv must be int8 [2, blocks, block, heads, dim]");
  TORCH_CHECK(kv_scales.scalar_type() == torch::kHalf && kv_scales.dim() == 4, "kv scales must be fp16");
  TORCH_CHECK(kv.is_contiguous() && kv_scales.is_contiguous(), "kv and its scales must be contiguous");
  const bool windowed = ring.has_value();
  if (windowed) {
    TORCH_CHECK(ring->scalar_type() == torch::kFloat && ring->is_contiguous() && ring->dim() == 5,
                "the ring must be contiguous fp32 [2, slots, window, heads, dim]");
    TORCH_CHECK(ring_slots.has_value() && ring_lo.has_value(), "a ring needs slots and lower bounds");
  }
  auto qf = q.to(torch::kFloat).contiguous();
  auto out = torch::empty_like(qf);
  auto bt_t = block_tables.contiguous();
  auto sl_t = seq_lens.contiguous();
  const int64_t B = qf.size(0), H = qf.size(1), D = qf.size(2);
  const int64_t NB = kv.size(1), BS = kv.size(2), KVH = kv.size(3);
  const int64_t G = H / KVH, MB = bt_t.size(1);
  const int8_t* kbase = kv.data_ptr<int8_t>();
  const int8_t* vbase = kbase + NB * BS * KVH * D;
  const at::Half* ksc = kv_scales.data_ptr<at::Half>();
  const at::Half* vsc = ksc + NB * BS * KVH;
  const float* qp = qf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* bt = bt_t.data_ptr<int64_t>();
  const int64_t* sl = sl_t.data_ptr<int64_t>();
  torch::Tensor slots_t, lo_t;
  const float* rk = nullptr;
  const float* rv = nullptr;
  const int64_t* slots = nullptr;
  const int64_t* lo = nullptr;
  int64_t W = 1;
  if (windowed) {
    W = ring->size(2);
    rk = ring->data_ptr<float>();
    rv = rk + ring->size(1) * W * KVH * D;
    slots_t = ring_slots->contiguous();
    lo_t = ring_lo->contiguous();
    slots = slots_t.data_ptr<int64_t>();
    lo = lo_t.data_ptr<int64_t>();
  }
  const float sc = static_cast<float>(scale);
  if (vec_loads::kSimd && !windowed && (D == 64 || D == 128) && H % KVH == 0) {
    const Int8Rows src{{kbase, vbase}, {ksc, vsc}, BS, KVH, D, BS * KVH * D};
    decode_batch_simd(op, qp, src, bt, sl, B, H, D, KVH, BS, MB, sc);
    return out.to(q.scalar_type());
  }
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, conv;
    std::vector<const float*> krows, vrows;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, kh = task % KVH;
      const int64_t L = sl[b];
      const int64_t first_fp = windowed ? std::min(L, lo[b]) : L;
      scores.resize(G * L);
      krows.resize(L);
      vrows.resize(L);
      conv.resize(2 * first_fp * D);
      for (int64_t t = 0; t < first_fp; ++t) {
        const int64_t row = (bt[b * MB + t / BS] * BS + t % BS) * KVH + kh;
        float* kc = conv.data() + t * D;
        float* vc = conv.data() + (first_fp + t) * D;
        dequant_row(kbase + row * D, static_cast<float>(ksc[row]), kc, D);
        dequant_row(vbase + row * D, static_cast<float>(vsc[row]), vc, D);
        krows[t] = kc;
        vrows[t] = vc;
      }
      for (int64_t t = first_fp; t < L; ++t) {
        const int64_t off = ((slots[b] * W + t % W) * KVH + kh) * D;
        krows[t] = rk + off;
        vrows[t] = rv + off;
      }
      attend_heads(qp, op, krows.data(), vrows.data(), scores.data(), b, kh, G, H, L, D, sc);
    }
  });
  return out.to(q.scalar_type());
}
