"""The engine against HF transformers on the same weights (fp32).

Tiny random-weight models: logits match within 1e-4 at every prefill position
and every decode step, through the real scheduler (chunked prefill, mixed
prefill/decode batches) and both CPU attention backends. SmolLM2: greedy
tokens equal HF's for a mixed-length batch.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.compact_weights import is_compact
from engine.models.linear import Linear
from engine.scheduler import ScheduledRequest
from tests.conftest import write_tiny_model

pytestmark = pytest.mark.reference

ARCHS = {
    "llama": ("llama", {}),
    "llama3-rope-tied": ("llama", {"tie": True, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}
# (attention backend, cpu_prepack_weights): with packed weights, decode-only steps run every layer in
# one C++ call (decode_layers) where the model allows it (not Qwen3's q/k norms).
BACKENDS = {"torch": ("torch", False), "cpu_paged": ("cpu_paged", False),
            "cpu_paged-prepacked": ("cpu_paged", True)}


@pytest.fixture(scope="module", params=list(ARCHS))
def tiny_pair(request, tmp_path_factory):
    import transformers

    arch, overrides = ARCHS[request.param]
    path = write_tiny_model(tmp_path_factory.mktemp(request.param), arch, seed=1, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def panel_kernel() -> bool:
    """Whether the panel kernel (and with it compact panels and the one-call decoder) must run here: on every host
    with AVX2 or AVX-512, whichever path INFINILM_CPU_ISA picks. Derived from the CPU, not from the kernel, so a
    missing kernel fails the checks that use this rather than switching them off."""
    from engine.kernels.cpu_build import target_isa

    return target_isa() != "baseline"


def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("variant", BACKENDS)
def test_decode_and_prefill_logits_match_hf_through_the_scheduler(tiny_pair, variant, decode_layers_calls):
    path, hf = tiny_pair
    backend, prepack = BACKENDS[variant]
    llm = LLM(model=str(path), dtype="float32", attention_backend=backend, max_num_batched_tokens=32,
              block_size=8, num_kv_blocks=64, cpu_prepack_weights=prepack)
    engine = llm.engine
    engine.runner.capture_logits = True
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 17, 40, 70)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    seen: dict[str, list[tuple[int, torch.Tensor]]] = {f"r{i}": [] for i in range(len(prompts))}
    mixed_steps = 0
    while engine.has_unfinished_requests():
        # Capture the position each request samples at before the step appends a token.
        positions = {rid: r.num_tokens - 1 for rid, r in engine.scheduler.requests.items()}
        engine.step()
        stats = engine.last_stats
        mixed_steps += stats.step_decode_seqs > 0 and stats.step_prefill_tokens > 0
        for rid, logits in engine.runner.last_logits.items():
            seen[rid].append((positions[rid], logits))
    assert mixed_steps > 0, "the batch never mixed prefill and decode"
    fused_expected = prepack and panel_kernel() and engine.model.layers[0].self_attn.q_norm is None
    assert bool(decode_layers_calls) == fused_expected, (variant, len(decode_layers_calls))
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        out_tokens = [int(lg.argmax()) for _, lg in seen[rid]]
        ref = hf_logits(hf, prompt + out_tokens[:-1])
        assert len(seen[rid]) == 8
        for pos, logits in seen[rid]:
            torch.testing.assert_close(logits, ref[pos], atol=1e-4, rtol=0)


def test_prefill_logits_match_hf_at_every_position(tiny_pair):
    path, hf = tiny_pair
    llm = LLM(model=str(path), dtype="float32", attention_backend="torch", block_size=8, num_kv_blocks=32)
    engine = llm.engine
    prompt = list(range(3, 100))
    req = engine.add_request("p", prompt, SamplingParams(max_tokens=1))
    assert engine.block_manager.allocate(req, len(prompt))
    sched = ScheduledRequest("p", prompt, 0, req.block_ids, True, req.mask, req.params, None, req.token_ids)
    with torch.inference_mode():
        ids, positions, meta = engine.runner._prepare([], [sched])
        hidden = engine.model(ids, positions, engine.kv_caches, meta)
        ours = engine.model.compute_logits(hidden)
    torch.testing.assert_close(ours, hf_logits(hf, prompt), atol=1e-4, rtol=0)


SMOL_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "List three prime numbers."}],
    [{"role": "system", "content": "You are a terse assistant that answers in one sentence."},
     {"role": "user", "content": "Explain what Apache Kafka is used for, and why teams pick it for event "
                                 "streaming instead of a plain message queue."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [{"role": "user", "content": "Write a Python function that returns the square of a number."}],
]


@pytest.fixture(scope="module")
def smollm2_pair():
    import transformers

    from engine.model_registry import resolve_model

    path = resolve_model("smollm2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


@pytest.mark.parametrize(("prepack", "compact"), [(False, False), (True, False), (True, True)],
                         ids=["plain", "prepacked", "prepacked-compact"])
def test_smollm2_greedy_tokens_equal_hf_in_a_mixed_batch(smollm2_pair, prepack, compact, decode_layers_calls):
    path, hf = smollm2_pair
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=64, cpu_prepack_weights=prepack,
              cpu_compact_weights=compact)
    # SmolLM2's GGUF import is Q4_1 codes (linears) and Q8_0 (embedding): compact panels take every weight.
    packed = [m.packed for m in llm.engine.model.modules() if isinstance(m, Linear)]
    assert all(is_compact(p) for p in packed) == (compact and panel_kernel())
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(c), add_special_tokens=False) for c in SMOL_PROMPTS]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=5)
    outs = llm.generate(prompts, params)
    assert bool(decode_layers_calls) == (prepack and panel_kernel())
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=24, do_sample=False, output_logits=True, return_dict_in_generate=True)
        ref_tokens = ref.sequences[0, len(prompt):].tolist()
        ref_tokens = ref_tokens[: len(out.token_ids)] if out.finish_reason == "stop" else ref_tokens
        if out.token_ids == ref_tokens:
            continue
        # fp32 near-ties may flip; then each choice must be within the other's top-5.
        i = next(j for j, (a, b) in enumerate(zip(out.token_ids, ref_tokens, strict=False)) if a != b)
        ours_top = [t for t, _ in out.logprobs[i][1]]
        ref_top = ref.logits[i][0].topk(5).indices.tolist()
        assert ref_tokens[i] in ours_top and out.token_ids[i] in ref_top, (out.token_ids, ref_tokens)


def test_smollm2_compact_panels_give_bitwise_the_fp32_panels_logprobs(smollm2_pair):
    if not panel_kernel():
        pytest.skip("this host lacks AVX2: compact panels run on the panel kernel, which needs AVX2 or AVX-512")
    path, _ = smollm2_pair
    chats = SMOL_PROMPTS[:3]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5)
    runs = {}
    # fp32 panels; compact panels; compact panels with the fp32 weights freed (rows and prefill rebuilt).
    for arm, compact, free in (("fp32", False, False), ("compact", True, False), ("freed", True, True)):
        llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=64, cpu_prepack_weights=True,
                  cpu_compact_weights=compact, cpu_free_plain_weights=free)
        runs[arm] = (llm.chat(chats, params), llm.engine.prepacked_bytes, llm.engine.weight_bytes)
    for arm in ("compact", "freed"):
        for a, b in zip(runs["fp32"][0], runs[arm][0], strict=True):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert runs["compact"][1] < 0.25 * runs["fp32"][1]  # 4-bit and 8-bit codes with fp16 scales
    assert runs["freed"][2] < 0.01 * runs["compact"][2]  # only the norms stay in fp32


def test_smollm2_generated_token_logprobs_equal_hf_within_tolerance(smollm2_pair):
    """What a chat result's `logprobs` report: each generated token's log-probability and the top alternatives,
    against HF's log-softmax over the same sequence in one forward pass."""
    path, hf = smollm2_pair
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=256)
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(c), add_special_tokens=False) for c in SMOL_PROMPTS[:3]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, logprobs=3))
    worst = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.logprobs) == len(out.token_ids)
        ref = torch.log_softmax(hf_logits(hf, prompt + out.token_ids[:-1]), dim=-1)[len(prompt) - 1:]
        for i, (token, (chosen, top)) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            worst = max(worst, abs(chosen - ref[i, token].item()))
            for alt, lp in top:
                worst = max(worst, abs(lp - ref[i, alt].item()))
            ref_top = ref[i].topk(4)
            # The alternatives are HF's top 3, in its order, unless two of them (or the 3rd and 4th) nearly tie.
            if (ref_top.values[:-1] - ref_top.values[1:]).min() >= 1e-3:
                assert [t for t, _ in top] == ref_top.indices.tolist()[:3]
    print(f"largest |logprob - HF| {worst:.2e}")
    assert worst < 1e-3, worst  # room for the kernels of every ISA, which sum in different orders
