"""bench.kernels.activation_chunk: a round is the engine's prefill steps, whatever workspace the model holds."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.models.llama import ActivationWorkspace


@pytest.mark.slow
def test_a_round_sums_its_prefill_steps_and_the_arms_sample_the_same_tokens(tiny_llama):
    from bench.kernels import activation_chunk

    llm = LLM(model=str(tiny_llama), dtype="float32", max_num_batched_tokens=64, enable_prefix_caching=True)
    model, cfg = llm.engine.model, llm.engine.model.config
    assert model.layers[0].mlp.workspace is None  # 2048-row chunks at a 64-token budget: none allocated
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (50, 40, 33)]
    results = {}
    for rows in (16, 0):
        model.use_workspace(ActivationWorkspace(rows, cfg.hidden_size, cfg.intermediate_size, torch.float32,
                                                torch.device("cpu")) if rows else None)
        calls: list[int] = []
        hook = model.layers[0].mlp.gate_up_proj.register_forward_pre_hook(
            lambda _m, a, calls=calls: calls.append(a[0].shape[0]))
        results[rows] = activation_chunk.run_round(llm, prompts, f"r{rows}")
        hook.remove()
        # 123 prompt tokens at 64 a step: two steps, so the 16-row arm runs its MLP in chunks of 16.
        assert max(calls) == (16 if rows else 64)
    # Both rounds prefilled full 64-token steps: the prefix cache, reset before each round, served no prompt.
    for seconds, longest, tokens in results.values():
        assert seconds > 0 and longest == 64 and len(tokens) == 3
    assert results[16][2] == results[0][2]


@pytest.mark.slow
def test_the_workload_rounds_alternate_the_arms_and_compare_their_tokens(tiny_llama):
    from bench.kernels import activation_chunk
    from bench.throughput import Workload

    llm = LLM(model=str(tiny_llama), dtype="float32", max_num_batched_tokens=64)
    cfg = llm.engine.model.config
    workspaces = {16: ActivationWorkspace(16, cfg.hidden_size, cfg.intermediate_size, torch.float32,
                                          torch.device("cpu")), 0: None}
    seen: list[object] = []
    use = llm.engine.model.use_workspace
    llm.engine.model.use_workspace = lambda ws: (seen.append(ws), use(ws))
    w = Workload([list(range(3, 60)), list(range(5, 90))], [4, 3])
    rounds = activation_chunk.run_workload(llm, [16, 0], workspaces, w, 2)
    assert seen == [workspaces[16], None, None, workspaces[16]]  # the order turns every other round
    assert len(rounds) == 2
    for r in rounds:
        assert set(r["wall_s"]) == set(r["prefill_steps_s"]) == {"16", "0"}
        assert all(r["prefill_steps_s"][k] <= r["wall_s"][k] for k in ("16", "0"))
        assert r["same_requests"] == {"16": 2, "0": 2}
