// Every decoder layer of a decode-only step in one call (fp32 CPU, panel-packed weights).
//
// Why: at small batches a decode step spends a large share of its time in Python between the
// kernels (module calls, splits, views, one torch dispatch per small op); bench.throughput's
// single-stream rows compare this path with the layer-by-layer one in the same run. This function
// runs the same sequence of kernels as engine/models/llama.py's DecoderLayer on the CPU path (the
// functions above in this translation unit, and at::add_ where the Python path calls torch), so a
// row's result is bitwise the same as the Python path's (tests/unit/test_fused_decode.py); only the
// bookkeeping moves out of the interpreter.
//
// Per layer, with x the residual stream [B, hidden], updated in place:
//   h = rms_norm(x); qkv = h @ Wqkv (+ b); rope(q, k); K/V rows -> their cache slots;
//   a = paged decode attention(q); x += a @ Wo; h = rms_norm(x); gu = h @ Wgu;
//   gate = silu(gate) * up (in place, silu_mul_rows_); x += gate @ Wdown.
// With a non-empty token_table (the embedding table, fp32 [vocab, hidden]), x holds the step's token ids and
// their rows are gathered here (the same values as the embedding lookup), saving the interpreter a call.
// From split_rows rows a thread the rows are cut into one contiguous group per thread, each thread running its
// group through every layer (row_groups below says why); below that, every kernel shares all rows over the threads.
// After the last layer, with a non-empty final_norm: the model's final RMSNorm of x (same epsilon), which
// is then what the call returns (x itself is still updated in place); with an empty one, x.
// With an int8 KV cache (kv_scales holds each layer's fp16 scales), new K/V rows are quantized as
// engine/attention/kv_int8.py's quantize_rows does (absmax / 127 rounded to fp16, codes rounded half
// to even) and attention reads the int8 pool (paged_decode_attention_int8, no full-precision ring).

// kv_int8.py's clamp bounds for a scale: the smallest normal fp16 and the largest fp16.
constexpr float kKvScaleMin = 6.103515625e-05f, kKvScaleMax = 65504.f;

static void quantize_row_int8(const float* x, int64_t D, int8_t* codes, at::Half* scale) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float s = std::min(std::max(amax / 127.f, kKvScaleMin), kKvScaleMax);
  const at::Half stored(s);
  const float sf = static_cast<float>(stored);
  for (int64_t d = 0; d < D; ++d)
    codes[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[d] / sf))));
  *scale = stored;
}

// x += y over rows (fp32 [rows, D], y contiguous; x's rows may be strided): the elementwise sums that
// x.add_(y) computes, on the calling thread.
static void add_rows_(torch::Tensor x, const torch::Tensor& y) {
  const int64_t rows = x.size(0), D = x.size(1), xs = x.stride(0);
  float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    at::vec::map2([](at::vec::Vectorized<float> a, at::vec::Vectorized<float> b) { return a + b; }, xp + r * xs,
                  xp + r * xs, yp + r * D, D);
}

// Multiply-adds of one row through one layer's linears (2 per weight).
static int64_t layer_flops_per_row(int64_t hidden, int64_t q_size, int64_t kv_size, int64_t intermediate) {
  return 2 * (hidden * (q_size + 2 * kv_size) + q_size * hidden + hidden * 2 * intermediate + intermediate * hidden);
}

// How decode_layers splits a step's B rows: the cut points [0, c1, ..., B] of contiguous groups, one per thread,
// with about equal work, a row's work being its linears (flops_per_row) and its attention's KV reads (lens[b]
// context rows of kv_row_bytes each), weighed at one core's typical rates (about 100 GFLOP/s and 15 GB/s of
// KV); or {0, B}, one group, below split_rows rows a thread or with one thread.
//
// Why: with one group, each kernel of a layer shares its rows out over the threads and the threads meet at the
// end of every kernel, about 240 times a step; with a group per thread, each thread runs its rows through every
// layer and the threads meet once, at the end. The price is that every thread streams the whole weight for its
// own rows, which loses where reads are slow against the GEMM rate (docs/perf/engine-notes.md, "Decode split").
// The engine therefore picks split_rows per machine (engine/models/decode_split.py): the rows from which a
// thread's GEMMs on its own copy of the weight stream are compute-bound.
// Every kernel computes a row the same way whatever rows share its call, so the results are bitwise the same
// either way.
static std::vector<int64_t> row_groups(const int64_t* lens, int64_t B, int64_t threads, int64_t flops_per_row,
                                       int64_t kv_row_bytes, int64_t split_rows) {
  TORCH_CHECK(split_rows >= 1, "decode_layers: split_rows (rows per thread from which to split) must be at least 1, "
              "got ", split_rows);
  if (threads < 2 || B < split_rows * threads) return {0, B};
  std::vector<double> cost(B);
  double total = 0;
  for (int64_t b = 0; b < B; ++b) {
    cost[b] = static_cast<double>(flops_per_row) / 100.0 + static_cast<double>(lens[b] * kv_row_bytes) / 15.0;
    total += cost[b];
  }
  std::vector<int64_t> cuts{0};
  double acc = 0;  // the cost of rows [0, b)
  for (int64_t b = 0; b < B && static_cast<int64_t>(cuts.size()) < threads; ++b) {
    const double target = total * static_cast<double>(cuts.size()) / static_cast<double>(threads);
    if (acc + cost[b] >= target) {
      // Row b crosses the next group's share: cut before it or after it, whichever lands nearer (after it
      // where its group would otherwise be empty).
      const bool before = b > cuts.back() && target - acc <= acc + cost[b] - target;
      cuts.push_back(before ? b : b + 1);
    }
    acc += cost[b];
  }
  cuts.push_back(B);
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  return cuts;
}

// row_groups for a step's sequence lengths (int64), as decode_layers would cut it with split_rows: for tests.
std::vector<int64_t> decode_row_groups(torch::Tensor seq_lens, int64_t threads, int64_t flops_per_row,
                                       int64_t kv_row_bytes, int64_t split_rows) {
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == torch::kLong, "decode_row_groups: int64 lengths");
  auto lens = seq_lens.contiguous();
  return row_groups(lens.data_ptr<int64_t>(), lens.numel(), threads, flops_per_row, kv_row_bytes, split_rows);
}

// Every thread reads every byte of `tensors` (contiguous; 64-byte words, xor-folded into the value returned so that
// the loads stay), all threads at once: what a split decode step asks of the memory, where each thread streams the
// whole weight for its own rows. engine/models/decode_split.py times it to decide when the split pays.
int64_t stream_read_all(std::vector<torch::Tensor> tensors) {
  for (const auto& t : tensors)
    TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "stream_read_all: tensors must be contiguous CPU tensors");
  typedef uint64_t Word __attribute__((vector_size(64)));  // one cache line; AVX-512 loads where the CPU has them
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  std::vector<uint64_t> folded(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      Word a{}, b{}, c{}, d{};
      uint64_t tail = 0;
      for (const auto& x : tensors) {
        const auto* p = static_cast<const unsigned char*>(x.data_ptr());
        const int64_t n = x.numel() * x.element_size();
        int64_t i = 0;
        for (; i + 256 <= n; i += 256) {
          Word v[4];
          std::memcpy(v, p + i, sizeof v);
          a ^= v[0];
          b ^= v[1];
          c ^= v[2];
          d ^= v[3];
        }
        for (; i < n; ++i) tail ^= p[i];
      }
      const Word all = a ^ b ^ c ^ d;
      for (int w = 0; w < 8; ++w) tail ^= all[w];
      folded[t] = tail;
    }
  });
  uint64_t all = 0;
  for (uint64_t v : folded) all ^= v;
  return static_cast<int64_t>(all & 0x7FFFFFFFFFFFFFFFull);
}

struct DecodeLayerWeights {
  torch::Tensor in_norm, qkv, qkv_bias, o, post_norm, gate_up, down;
};

torch::Tensor decode_layers(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> kv_caches,
                            std::vector<torch::Tensor> kv_scales, torch::Tensor slot_mapping,
                            torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor positions,
                            torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t intermediate, double eps, double scale, torch::Tensor final_norm,
                            torch::Tensor token_table, int64_t split_rows) {
  constexpr size_t kPerLayer = 7;
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(weights.size() == kPerLayer * kv_caches.size(), "decode_layers: ", kPerLayer,
              " weights per layer expected (norm, qkv, qkv bias, o, norm, gate_up, down), got ", weights.size(),
              " for ", layers, " layers");
  if (token_table.numel() > 0) {  // x holds token ids: their rows of the embedding table are the input
    TORCH_CHECK(token_table.dim() == 2 && token_table.is_contiguous() && token_table.scalar_type() == torch::kFloat,
                "decode_layers: token_table must be a contiguous fp32 [vocab, hidden] tensor");
    TORCH_CHECK(x.dim() == 1 && x.scalar_type() == torch::kLong, "decode_layers: with a token_table, x must be "
                "int64 token ids [tokens]");
    const int64_t V = token_table.size(0), D = token_table.size(1), n = x.size(0);
    auto ids = x.contiguous();
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t b = 0; b < n; ++b)
      TORCH_CHECK(id[b] >= 0 && id[b] < V, "decode_layers: token id ", id[b], " outside the vocabulary [0, ", V, ")");
    auto rows = torch::empty({n, D}, token_table.options());
    const float* table = token_table.data_ptr<float>();
    float* out = rows.data_ptr<float>();
    for (int64_t b = 0; b < n; ++b) std::memcpy(out + b * D, table + id[b] * D, D * sizeof(float));
    x = rows;
  }
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat, "decode_layers: x must be a "
              "contiguous fp32 [tokens, hidden] tensor");
  const int64_t B = x.size(0), hidden = x.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(slot_mapping.numel() == B && positions.numel() == B && seq_lens.numel() == B &&
                  block_tables.size(0) == B,
              "decode_layers: one slot, position, sequence length and block table per token");
  TORCH_CHECK(final_norm.numel() == 0 || (final_norm.numel() == hidden && final_norm.scalar_type() == torch::kFloat),
              "decode_layers: final_norm must be empty or ", hidden, " fp32 weights");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && positions.scalar_type() == torch::kLong,
              "decode_layers: slot_mapping and positions must be int64");
  auto slots_c = slot_mapping.contiguous();
  auto pos_c = positions.contiguous();
  auto bt = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t* slots = slots_c.data_ptr<int64_t>();
  const bool int8_kv = !kv_scales.empty();
  TORCH_CHECK(!int8_kv || kv_scales.size() == kv_caches.size(), "decode_layers: ", kv_scales.size(),
              " KV scale tensors for ", layers, " layers (one per layer for an int8 cache, none for fp32)");
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor& kv = kv_caches[l];
    TORCH_CHECK(kv.dim() == 5 && kv.is_contiguous() && kv.scalar_type() == (int8_kv ? torch::kChar : torch::kFloat) &&
                    kv.size(3) == num_kv_heads && kv.size(4) == head_dim,
                "decode_layers: layer ", l, "'s KV cache must be a contiguous ", int8_kv ? "int8" : "fp32",
                " [2, blocks, block_size, ", num_kv_heads, ", ", head_dim, "] tensor");
    if (int8_kv)
      TORCH_CHECK(kv_scales[l].is_contiguous() && kv_scales[l].scalar_type() == torch::kHalf &&
                      kv_scales[l].sizes() == kv.sizes().slice(0, 4),
                  "decode_layers: layer ", l, "'s KV scales must be contiguous fp16 [2, blocks, block_size, ",
                  num_kv_heads, "]");
    const int64_t capacity = kv.size(1) * kv.size(2);
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(slots[b] >= 0 && slots[b] < capacity, "decode_layers: slot ", slots[b], " outside the cache");
  }
  // Every layer for rows [r0, r0 + n) of the step, those rows of x updated in place.
  auto run_rows = [&](int64_t r0, int64_t n) {
    auto x_rows = x.narrow(0, r0, n);
    const int64_t* row_slots = slots + r0;
    auto row_pos = pos_c.narrow(0, r0, n), row_bt = bt.narrow(0, r0, n), row_lens = lens.narrow(0, r0, n);
    for (int64_t l = 0; l < layers; ++l) {
      const DecodeLayerWeights w{weights[kPerLayer * l], weights[kPerLayer * l + 1], weights[kPerLayer * l + 2],
                                 weights[kPerLayer * l + 3], weights[kPerLayer * l + 4], weights[kPerLayer * l + 5],
                                 weights[kPerLayer * l + 6]};
      const torch::Tensor& kv = kv_caches[l];
      // Attention block.
      auto h = rms_norm_rows(x_rows, w.in_norm, eps);
      c10::optional<torch::Tensor> bias;
      if (w.qkv_bias.numel() > 0) bias = w.qkv_bias;
      auto qkv = panel_linear(h, w.qkv, q_size + 2 * kv_size, bias);
      auto q = qkv.narrow(1, 0, q_size).view({n, num_heads, head_dim});
      auto k = qkv.narrow(1, q_size, kv_size).view({n, num_kv_heads, head_dim});
      rope_rows_(q, k, cos, sin, row_pos);
      const int64_t half = kv.stride(0);
      const float* rows = qkv.data_ptr<float>();
      const int64_t ld = qkv.stride(0);
      torch::Tensor attn;
      if (int8_kv) {
        int8_t* codes = kv.data_ptr<int8_t>();
        at::Half* scales = kv_scales[l].data_ptr<at::Half>();
        const int64_t scale_half = kv_scales[l].stride(0);
        for (int64_t b = 0; b < n; ++b)
          for (int64_t side = 0; side < 2; ++side)
            for (int64_t h = 0; h < num_kv_heads; ++h)
              quantize_row_int8(rows + b * ld + q_size + side * kv_size + h * head_dim, head_dim,
                                codes + side * half + row_slots[b] * kv_size + h * head_dim,
                                scales + side * scale_half + row_slots[b] * num_kv_heads + h);
        attn = paged_decode_attention_int8(q, kv, kv_scales[l], row_bt, row_lens, scale, c10::nullopt, c10::nullopt,
                                           c10::nullopt);
      } else {
        float* cache = kv.data_ptr<float>();
        for (int64_t b = 0; b < n; ++b) {
          std::memcpy(cache + row_slots[b] * kv_size, rows + b * ld + q_size, kv_size * sizeof(float));
          std::memcpy(cache + half + row_slots[b] * kv_size, rows + b * ld + q_size + kv_size, kv_size * sizeof(float));
        }
        attn = paged_decode_attention(q, kv, row_bt, row_lens, scale);
      }
      auto o = panel_linear(attn.view({n, q_size}), w.o, hidden, c10::nullopt);
      // MLP block.
      h = add_rms_norm_rows(x_rows, o, w.post_norm, eps);
      auto gate_up = panel_linear(h, w.gate_up, 2 * intermediate, c10::nullopt);
      silu_mul_rows_(gate_up, intermediate);
      auto down = panel_linear(gate_up.narrow(1, 0, intermediate), w.down, hidden, c10::nullopt);
      add_rows_(x_rows, down);
    }
  };
  const std::vector<int64_t> cuts = row_groups(lens.data_ptr<int64_t>(), B, at::get_num_threads(),
                                               layer_flops_per_row(hidden, q_size, kv_size, intermediate),
                                               layers > 0 ? 2 * kv_size * kv_caches[0].element_size() : 0,
                                               split_rows);
  if (cuts.size() <= 2) {
    run_rows(0, B);  // one group: every kernel shares its rows out over the threads
  } else {
    // One group of rows per thread, each through every layer on its own: the kernels called inside run on the
    // calling thread (ATen runs a parallel_for nested in another inline), and the threads meet only at the end.
    // The final norm below shares all rows out again.
    const at::ThreadLocalState state;  // the caller's grad and inference modes, for the tensors made inside
    at::parallel_for(0, static_cast<int64_t>(cuts.size()) - 1, 1, [&](int64_t g0, int64_t g1) {
      const at::ThreadLocalStateGuard guard(state);
      for (int64_t g = g0; g < g1; ++g) run_rows(cuts[g], cuts[g + 1] - cuts[g]);
    });
  }
  return final_norm.numel() > 0 ? rms_norm_rows(x, final_norm, eps) : x;
}
