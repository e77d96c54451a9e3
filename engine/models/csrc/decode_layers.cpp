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

struct DecodeLayerWeights {
  torch::Tensor in_norm, qkv, qkv_bias, o, post_norm, gate_up, down;
};

torch::Tensor decode_layers(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> kv_caches,
                            std::vector<torch::Tensor> kv_scales, torch::Tensor slot_mapping,
                            torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor positions,
                            torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t intermediate, double eps, double scale, torch::Tensor final_norm,
                            torch::Tensor token_table) {
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
  for (int64_t l = 0; l < layers; ++l) {
    const DecodeLayerWeights w{weights[kPerLayer * l], weights[kPerLayer * l + 1], weights[kPerLayer * l + 2],
                               weights[kPerLayer * l + 3], weights[kPerLayer * l + 4], weights[kPerLayer * l + 5],
                               weights[kPerLayer * l + 6]};
    const torch::Tensor& kv = kv_caches[l];
    // Attention block.
    auto h = rms_norm_rows(x, w.in_norm, eps);
    c10::optional<torch::Tensor> bias;
    if (w.qkv_bias.numel() > 0) bias = w.qkv_bias;
    auto qkv = panel_linear(h, w.qkv, q_size + 2 * kv_size, bias);
    auto q = qkv.narrow(1, 0, q_size).view({B, num_heads, head_dim});
    auto k = qkv.narrow(1, q_size, kv_size).view({B, num_kv_heads, head_dim});
    rope_rows_(q, k, cos, sin, pos_c);
    const int64_t half = kv.stride(0);
    const float* rows = qkv.data_ptr<float>();
    const int64_t ld = qkv.stride(0);
    torch::Tensor attn;
    if (int8_kv) {
      int8_t* codes = kv.data_ptr<int8_t>();
      at::Half* scales = kv_scales[l].data_ptr<at::Half>();
      const int64_t scale_half = kv_scales[l].stride(0);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t side = 0; side < 2; ++side)
          for (int64_t h = 0; h < num_kv_heads; ++h)
            quantize_row_int8(rows + b * ld + q_size + side * kv_size + h * head_dim, head_dim,
                              codes + side * half + slots[b] * kv_size + h * head_dim,
                              scales + side * scale_half + slots[b] * num_kv_heads + h);
      attn = paged_decode_attention_int8(q, kv, kv_scales[l], bt, lens, scale, c10::nullopt, c10::nullopt,
                                         c10::nullopt);
    } else {
      float* cache = kv.data_ptr<float>();
      for (int64_t b = 0; b < B; ++b) {
        std::memcpy(cache + slots[b] * kv_size, rows + b * ld + q_size, kv_size * sizeof(float));
        std::memcpy(cache + half + slots[b] * kv_size, rows + b * ld + q_size + kv_size, kv_size * sizeof(float));
      }
      attn = paged_decode_attention(q, kv, bt, lens, scale);
    }
    auto o = panel_linear(attn.view({B, q_size}), w.o, hidden, c10::nullopt);
    // MLP block.
    h = add_rms_norm_rows(x, o, w.post_norm, eps);
    auto gate_up = panel_linear(h, w.gate_up, 2 * intermediate, c10::nullopt);
    silu_mul_rows_(gate_up, intermediate);
    x.add_(panel_linear(gate_up.narrow(1, 0, intermediate), w.down, hidden, c10::nullopt));
  }
  return final_norm.numel() > 0 ? rms_norm_rows(x, final_norm, eps) : x;
}
