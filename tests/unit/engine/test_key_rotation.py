"""Keys rotated by a Hadamard matrix after RoPE (kv_key_rotation): the attention they compute is the same,
the fp8 cache stores them with less loss, the fused RoPE + K/V write rotates them itself, and the one-call
CPU decoder, which cannot rotate, stands aside."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.attention.key_rotation import hadamard, resolve_key_rotation
from engine.errors import InvalidRequestError

CPU = torch.device("cpu")


@pytest.mark.parametrize("n", [1, 2, 16, 64, 128])
def test_hadamard_is_orthogonal_and_symmetric(n):
    h = hadamard(n)
    torch.testing.assert_close(h @ h.T, torch.eye(n), atol=1e-6, rtol=0)
    assert torch.equal(h, h.T)
    assert torch.all(h.abs() == n**-0.5)  # every row spreads over every channel evenly


def test_auto_rotates_fp8_keys_only_where_head_dim_is_a_power_of_two():
    assert resolve_key_rotation("auto", "fp8", 64, CPU) is not None
    assert resolve_key_rotation("auto", "int8", 64, CPU) is None
    assert resolve_key_rotation("auto", "fp8", 80, CPU) is None
    assert resolve_key_rotation("none", "fp8", 64, CPU) is None
    assert resolve_key_rotation("hadamard", "int8", 64, CPU) is not None
    with pytest.raises(InvalidRequestError, match="power-of-two head_dim, the model's is 80"):
        resolve_key_rotation("hadamard", "fp8", 80, CPU)
    with pytest.raises(InvalidRequestError, match="kv_key_rotation must be auto, hadamard or none"):
        resolve_key_rotation("walsh", "fp8", 64, CPU)
    with pytest.raises(InvalidRequestError, match="it needs cache_bits: 8"):
        EngineConfig(kv_key_rotation="hadamard")


def greedy(llm: LLM) -> list:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    return llm.generate([[5, 9, 40, 41, 300, 7, 7, 12] * 3, [100, 3, 250]], params)


def test_rotated_keys_give_the_same_attention_at_full_precision(tiny_llama):
    """q R (k R)^T = q k^T: the rotation alone changes nothing but rounding. (No prefix cache: its blocks
    from the first run hold unrotated keys, which is why an engine never changes its rotation.)"""
    llm = LLM(model=str(tiny_llama), dtype="float32", attention_backend="torch", num_kv_blocks=32,
              enable_prefix_caching=False)
    plain = greedy(llm)
    llm.engine.model.layers[0].self_attn.backend.key_rotation = hadamard(llm.engine.model.config.head_dim)
    rotated = greedy(llm)
    for a, b in zip(plain, rotated, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor([s[0] for s in a.logprobs]), torch.tensor([s[0] for s in b.logprobs]),
                                   atol=1e-5, rtol=0)


def test_an_fp8_cache_rotates_by_default_and_the_one_call_cpu_decoder_stands_aside(tiny_llama):
    fp8 = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=32, cache_bits=8, cache_format="fp8")
    assert fp8.engine.model.layers[0].self_attn.backend.key_rotation is not None
    # int8 with a rotation: the C++ backend reads the rotated keys; decode_layers, which cannot rotate, is off.
    rotated = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=32, cache_bits=8, cache_format="int8",
                  kv_key_rotation="hadamard")
    plain = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=32, cache_bits=8, cache_format="int8")
    assert rotated.engine.model.fused_decoder is None
    assert plain.engine.model.layers[0].self_attn.backend.key_rotation is None
    for a, b in zip(greedy(plain), greedy(rotated), strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor([s[0] for s in a.logprobs]), torch.tensor([s[0] for s in b.logprobs]),
                                   atol=0.05, rtol=0)


def test_the_fused_rope_and_kv_write_stays_on_when_keys_rotate(tiny_llama):
    """The RoPE + K/V-write kernel rotates q and k itself (rope_write_kv's rotation; tests/unit/engine/
    test_triton_kvq.py runs it)."""
    llm = LLM(model=str(tiny_llama), dtype="float32", attention_backend="torch", num_kv_blocks=32)
    model = llm.engine.model
    backend = model.layers[0].self_attn.backend
    backend.accepts_prewritten_kv = True  # as the Triton backends do
    backend.key_rotation = hadamard(model.config.head_dim)
    model.enable_triton_fusions()
    assert all(layer.self_attn.fused_rope_kv for layer in model.layers) and backend.kv_prewritten
