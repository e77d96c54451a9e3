"""cpu_prefill_dtype bfloat16: prompt-carrying steps run their tall linears from a bf16 copy of each weight.

The products run in bf16 on any CPU (oneDNN emulates the instructions where they are missing), so the numerics
are checked on every host; the start-up gate that refuses hosts without AVX512-BF16 or AMX is checked apart.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams, platform_tuning
from engine.errors import ModelLoadError
from engine.kernels import cpu_build
from engine.models import linear as lin
from tests.conftest import write_tiny_model


def bf16_reference(x, w, b):
    return F.linear(x.to(torch.bfloat16), w.to(torch.bfloat16)).float() + b


@torch.inference_mode()  # as the engine runs: the fast paths never take part in autograd
def test_prefill_steps_run_tall_products_in_bf16_and_everything_else_in_fp32():
    torch.manual_seed(0)
    w, b, x = torch.randn(48, 96), torch.randn(48), torch.randn(80, 96)
    wb = w.to(torch.bfloat16)
    exact = F.linear(x, w, b)
    lowered = bf16_reference(x, w, b)
    assert (lowered - exact).abs().max() > 1e-3  # far enough apart for the checks below to tell them apart
    with lin.prefill_step():
        assert torch.equal(lin.linear(x, w, b, bf16=wb), lowered)
        out = torch.empty(80, 48)
        assert lin.linear(x, w, b, out=out, bf16=wb) is out and torch.equal(out, lowered)
        short = x[:lin.BF16_MIN_ROWS - 1]
        torch.testing.assert_close(lin.linear(short, w, b, bf16=wb), F.linear(short, w, b), atol=1e-4, rtol=0)
        with lin.batch_invariant():  # deterministic requests keep their fp32 kernel
            torch.testing.assert_close(lin.linear(x, w, b, bf16=wb), exact, atol=1e-4, rtol=0)
        torch.testing.assert_close(lin.linear(x, w, b), exact, atol=1e-4, rtol=0)  # no copy: fp32
    torch.testing.assert_close(lin.linear(x, w, b, bf16=wb), exact, atol=1e-4, rtol=0)  # not a prefill step


@torch.inference_mode()
def test_bf16_copies_rebuild_freed_weights_from_their_compact_panels():
    if cpu_build.target_isa() == "baseline":
        pytest.skip("this host lacks AVX2: no compact panels to free weights into")
    from gguf import GGMLQuantizationType, quants

    q8 = GGMLQuantizationType.Q8_0  # a GGUF import's weight: integer codes times fp16 scales
    raw = (np.random.default_rng(1).standard_normal((64, 96)) * 0.05).astype(np.float32)
    weight = torch.from_numpy(quants.dequantize(quants.quantize(raw, q8), q8).copy())
    layer = lin.Linear(96, 64, bias=False)
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    lin.prepack_linears(layer, compact=True, free_plain=True)
    assert layer.weight.is_meta
    assert lin.add_bf16_copies(layer) == 64 * 96 * 2
    assert torch.equal(layer.bf16, weight.to(torch.bfloat16))


def test_bf16_matmul_isa_reads_the_cpu_flags_and_the_isa_cap(monkeypatch):
    avx512 = "flags : fpu avx2 fma avx512f avx512bw avx512vl avx512dq"
    monkeypatch.delenv(cpu_build.ISA_ENV, raising=False)
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: avx512)
    assert cpu_build.bf16_matmul_isa() is None
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: avx512 + " avx512_bf16 avx512_vnni")
    assert cpu_build.bf16_matmul_isa() == "avx512_bf16"
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: avx512 + " avx512_bf16 amx_bf16 amx_tile")
    assert cpu_build.bf16_matmul_isa() == "amx_bf16"
    monkeypatch.setenv(cpu_build.ISA_ENV, "avx2")  # the cap stands for a host without them
    assert cpu_build.bf16_matmul_isa() is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("bf16-prefill"), "llama", seed=3)


def test_engine_start_refuses_bf16_prefill_where_it_would_be_slower_or_meaningless(tiny, monkeypatch):
    monkeypatch.setattr(platform_tuning, "bf16_matmul_isa", lambda: None)
    with pytest.raises(ModelLoadError, match="needs a CPU with bf16 instructions"):
        LLM(model=str(tiny), dtype="float32", num_kv_blocks=32, cpu_prefill_dtype="bfloat16")
    monkeypatch.setattr(platform_tuning, "bf16_matmul_isa", lambda: "avx512_bf16")
    with pytest.raises(ModelLoadError, match="lowers the prefill of fp32 models"):
        LLM(model=str(tiny), dtype="bfloat16", num_kv_blocks=32, cpu_prefill_dtype="bfloat16")


@pytest.mark.slow
def test_only_prompt_steps_multiply_in_bf16_and_their_logits_stay_close_to_hf(tiny, monkeypatch):
    import transformers

    monkeypatch.setattr(platform_tuning, "bf16_matmul_isa", lambda: "avx512_bf16")
    rows: list[int] = []
    real = lin._bf16_product
    monkeypatch.setattr(lin, "_bf16_product", lambda x, w, b: rows.append(x.shape[0]) or real(x, w, b))
    llm = LLM(model=str(tiny), dtype="float32", num_kv_blocks=64, block_size=8, max_num_batched_tokens=160,
              cpu_prefill_dtype="bfloat16")
    engine = llm.engine
    engine.runner.capture_logits = True
    prompts = [list(range(3, 103)), list(range(200, 270))]  # no shared prefix: both prefill in full
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    first: dict[str, torch.Tensor] = {}
    steps = []
    while engine.has_unfinished_requests():
        before = len(rows)
        engine.step()
        stats = engine.last_stats
        steps.append((stats.step_prefill_tokens, stats.step_prefill_tokens + stats.step_decode_seqs, len(rows) - before))
        for rid, logits in engine.runner.last_logits.items():
            first.setdefault(rid, logits)
    # A prompt step of BF16_MIN_ROWS rows or more runs its 8 products in bf16 (qkv, o, gate_up and down in each
    # of 2 layers); a shorter one (the prompt's last 10-token chunk beside a decode row) and decode-only steps none.
    assert [calls for _, _, calls in steps] == [8 if tokens and n >= lin.BF16_MIN_ROWS else 0
                                                for tokens, n, _ in steps], steps
    assert steps[0][2] == 8 and steps[1][0] == 10 and len(steps) > 3, steps
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1]
        ours = first[f"r{i}"]
        gap = (ours.log_softmax(-1) - ref.log_softmax(-1)).abs().max()
        assert gap < 5e-3, gap  # within bf16 rounding (measured 4e-4..7e-4)
        assert int(ours.argmax()) == int(ref.argmax())


@pytest.mark.slow
def test_smollm2_perplexity_with_bf16_prefill_stays_within_a_tenth_of_a_percent_of_fp32(monkeypatch):
    """Measured +0.00% on 4096 tokens of GPL-3 (docs/perf/cpu-engine.md); every scored position of a window
    comes from a prompt step, so the whole measure runs on the bf16 products."""
    from pathlib import Path

    from engine.perplexity import perplexity

    monkeypatch.setattr(platform_tuning, "bf16_matmul_isa", lambda: "avx512_bf16")
    text = Path("/usr/share/common-licenses/GPL-3").read_text()
    runs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model="smollm2", dtype="float32", max_num_batched_tokens=1024, cpu_prefill_dtype=dtype)
        ids = llm.tokenizer.encode(text)[:1024]
        runs[dtype] = perplexity(llm, ids, 512, 256).perplexity
        del llm
    assert runs["bfloat16"] != runs["float32"]  # the bf16 products ran
    assert abs(runs["bfloat16"] / runs["float32"] - 1) <= 0.001, runs
