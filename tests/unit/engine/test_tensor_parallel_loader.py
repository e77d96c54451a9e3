"""The shard loader reads exactly each rank's slice of every checkpoint tensor (no process group needed)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine.attention.torch_backend import TorchAttentionBackend
from engine.models.config import ModelConfig
from engine.parallel.layers import VocabParallelEmbedding
from engine.parallel.loader import load_shard
from engine.parallel.sharding import ShardPlan
from tests.conftest import write_tiny_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # qkv bias, one KV head (replicated on both ranks), an untied head, a vocabulary 2 does not divide.
    path = write_tiny_model(tmp_path_factory.mktemp("tp-loader"), "qwen2", seed=2, num_key_value_heads=1,
                            vocab_size=321)
    return path, load_file(str(next(path.glob("*.safetensors"))))


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_holds_exactly_its_rows_and_columns(checkpoint, rank):
    path, full = checkpoint
    mc = ModelConfig.from_folder(path)
    plan = ShardPlan.for_rank(mc, rank, 2)
    local = plan.local_config(mc)
    model = load_shard(path, mc, plan, TorchAttentionBackend(local.num_heads, local.num_kv_heads, local.head_dim),
                       64, torch.float32, torch.device("cpu"))
    q = slice(32 * rank, 32 * (rank + 1))  # 2 of 4 heads of 16
    inter = slice(64 * rank, 64 * (rank + 1))  # half of 128
    for i, layer in enumerate(model.layers):
        ck = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        for suffix in ("weight", "bias"):
            expected = torch.cat([full[f"{ck}self_attn.q_proj.{suffix}"][q],
                                  full[f"{ck}self_attn.k_proj.{suffix}"], full[f"{ck}self_attn.v_proj.{suffix}"]])
            assert torch.equal(getattr(attn.qkv_proj, suffix), expected)
        assert torch.equal(attn.o_proj.weight, full[f"{ck}self_attn.o_proj.weight"][:, q])
        assert torch.equal(mlp.gate_up_proj.weight, torch.cat([full[f"{ck}mlp.gate_proj.weight"][inter],
                                                               full[f"{ck}mlp.up_proj.weight"][inter]]))
        assert torch.equal(mlp.down_proj.weight, full[f"{ck}mlp.down_proj.weight"][:, inter])
        assert torch.equal(layer.input_layernorm.weight, full[f"{ck}input_layernorm.weight"])
    for ours, theirs in ((model.embed_tokens.weight, "model.embed_tokens.weight"),
                         (model.lm_head.weight, "lm_head.weight")):
        rows = full[theirs][161 * rank:161 * (rank + 1)]
        assert ours.shape == (161, 64)
        assert torch.equal(ours[:rows.shape[0]], rows)
        assert not ours[rows.shape[0]:].any()  # rank 1's last row pads the vocabulary to 322
    assert isinstance(model.embed_tokens, VocabParallelEmbedding) and model.embed_tokens.vocab_start == 161 * rank
    assert not any(p.is_meta for p in model.parameters())
