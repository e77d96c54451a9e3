"""The activation workspace: chunked in-place MLP for long prefills, and in-place RoPE.

The workspace only changes where activations live, never what is computed: the
chunked model must give the one-pass model's logits, the torch RoPE in place must be
bitwise equal to RoPE out of place, and the workspace must really be the
memory the MLP writes to.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.errors import InvalidRequestError
from engine.models.llama import ActivationWorkspace
from engine.models.rope import RotaryEmbedding

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in (150, 97, 40)]


def engine(path, chunk_rows: int, **options) -> LLM:
    llm = LLM(model=str(path), dtype="float32", block_size=8, activation_chunk_rows=chunk_rows,
              enable_prefix_caching=False, max_num_batched_tokens=1024, **options)
    llm.engine.runner.capture_logits = True
    return llm


def test_torch_rope_in_place_is_bitwise_equal_to_out_of_place():
    rope = RotaryEmbedding(32, 256, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                           torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 256, (37,), generator=g)
    qkv = torch.randn(37, 4 * 32 + 2 * 2 * 32, generator=g)
    q, k, _ = qkv.split([128, 64, 64], dim=-1)
    q, k = q.reshape(37, 4, 32), k.reshape(37, 2, 32)
    want_q, want_k = rope(positions, q.clone(), k.clone())
    rope.apply_torch_(positions, q, k)  # views of qkv, rotated where they lie
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, :128].reshape(37, 4, 32), want_q)


@pytest.mark.slow
@pytest.mark.parametrize("arch_fixture", ["tiny_llama"])
def test_chunked_mlp_matches_one_pass(request, arch_fixture):
    path = request.getfixturevalue(arch_fixture)
    one_pass = engine(path, 0)
    assert one_pass.engine.model.layers[0].mlp.workspace is None
    chunked = engine(path, 16)  # every prompt here is longer than 16 rows: all prefills run chunked
    ws = chunked.engine.model.layers[0].mlp.workspace
    assert isinstance(ws, ActivationWorkspace) and ws.rows == 16
    assert all(layer.mlp.workspace is ws for layer in chunked.engine.model.layers)

    calls: list[int] = []
    hook = chunked.engine.model.layers[0].mlp.gate_up_proj.register_forward_pre_hook(
        lambda _m, args: calls.append(args[0].shape[0]))
    a = one_pass.generate(prompts(), PARAMS)
    b = chunked.generate(prompts(), PARAMS)
    hook.remove()
    # The first step prefills all 287 prompt rows at once: 18 chunks of at most 16 rows.
    assert calls[:18] == [16] * 17 + [287 - 16 * 17]
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        for (tx, top_x), (ty, top_y) in zip(x.logprobs, y.logprobs, strict=True):
            assert tx == ty
            for (i, lx), (j, ly) in zip(top_x, top_y, strict=True):
                assert i == j and abs(lx - ly) < 1e-4


def test_mlp_writes_into_the_workspace(tiny_llama):
    llm = engine(tiny_llama, 16)
    mlp = llm.engine.model.layers[1].mlp
    ws = mlp.workspace
    ws.gate_up.fill_(float("nan"))
    x = torch.randn(40, mlp.gate_up_proj.in_features)
    residual = torch.zeros(40, mlp.down_proj.out_features)
    with torch.no_grad():
        got = mlp.add_to(x, residual)
        want = mlp(x)
    assert got is residual  # added in place
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.isnan(ws.gate_up).any()  # the three chunks wrote there
    # The last chunk (rows 32-39) left its projection in the workspace's first 8 rows: [silu(gate) * up | up].
    with torch.no_grad():
        gate, up = mlp.gate_up_proj(x[32:]).split(mlp.intermediate, dim=-1)
    torch.testing.assert_close(ws.gate_up[:8, mlp.intermediate:], up)
    torch.testing.assert_close(ws.gate_up[:8, :mlp.intermediate], torch.nn.functional.silu(gate) * up)


@pytest.mark.slow
def test_quantized_model_runs_chunked(tiny_llama):
    a = engine(tiny_llama, 0, weight_bits=8).generate(prompts(), PARAMS)
    b = engine(tiny_llama, 16, weight_bits=8).generate(prompts(), PARAMS)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_negative_chunk_rows_is_a_clear_error():
    with pytest.raises(InvalidRequestError, match="activation_chunk_rows"):
        EngineConfig(activation_chunk_rows=-1)


@pytest.mark.slow
def test_no_workspace_where_no_step_can_outgrow_it(tiny_llama):
    """A workspace only where a step may hold more rows than it (max_num_batched_tokens): the defaults'
    2048-row chunks at a 2048-token budget would never be used, so none is allocated."""
    at_budget = LLM(model=str(tiny_llama), dtype="float32", max_num_batched_tokens=2048)
    assert at_budget.engine.config.activation_chunk_rows == 2048
    assert at_budget.engine.model.layers[0].mlp.workspace is None
    larger = LLM(model=str(tiny_llama), dtype="float32", max_num_batched_tokens=4096)
    ws = larger.engine.model.layers[0].mlp.workspace
    assert isinstance(ws, ActivationWorkspace) and ws.rows == 2048
