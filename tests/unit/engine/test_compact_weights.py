"""Exact compact weight panels (engine/models/compact_weights.py, panel_gemm.cpp's rebuild_panel).

Weights that went through gguf's own quantize and dequantize (Q4_0, Q4_1, Q8_0) must be packed as
codes and rebuilt bit for bit, the panel kernel must give bitwise the fp32 panels' results, and any
weight that is not exactly such codes must keep the fp32 panels. SmolLM2 through the compact panels
is compared with HF transformers in tests/reference/test_engine_reference.py.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine import LLM, SamplingParams
from engine.kernels.cpu_build import cpu_kernels
from engine.models import compact_weights as cw
from engine.models import linear as lin
from tests.conftest import write_tiny_model

# Slow tier (loads SmolLM2): `ops/dev.sh test --fast` leaves it out.
# Every test runs on the AVX2 and the AVX-512 kernel module (tests/conftest.py's kernel_isa).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("kernel_isa")]

BLOCK = {"Q4_0": cw.SYM8_BLOCK, "Q4_1": cw.AFFINE4_BLOCK, "Q8_0": cw.SYM8_BLOCK}


def gguf_roundtrip(weight: np.ndarray, kind: str) -> torch.Tensor:
    """`weight` as a GGUF import holds it: gguf's quantize, then its dequantize (fp32)."""
    t = GGMLQuantizationType[kind]
    return torch.from_numpy(quants.dequantize(quants.quantize(weight, t), t).copy())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("kind", list(BLOCK))
@pytest.mark.parametrize(("n", "k"), [(100, 576), (32, 64), (7, 1536), (150, 128)])
def test_gguf_weights_pack_compactly_and_compute_bitwise_as_fp32_panels(kind, n, k):
    ops = cpu_kernels()
    rng = np.random.default_rng(n + k)
    w = gguf_roundtrip((rng.standard_normal((n, k)) * 0.05).astype(np.float32), kind)
    if kind == "Q4_0":
        assert bool((bits(w) == -(2**31)).any()), "Q4_0 with negative scales gives -0.0 values: the test needs some"
    packed = cw.pack_compact(w, ops.pack_compact_panels, ops.compact_panels_match)
    assert packed is not None and packed.dtype == torch.uint8
    assert tuple(packed.shape) == (-(-n // 32), k // 32, BLOCK[kind])
    assert torch.equal(bits(ops.unpack_compact_panels(packed, n)), bits(w))
    fp32 = ops.pack_panels(w)
    bias = torch.randn(n)
    # 1-12 rows run straight from the codes (4, 2 or 1 panels at a time), more through a rebuilt panel.
    for rows in (1, 2, 3, 4, 5, 8, 12, 13, 24, 50):
        x = torch.randn(rows, k)
        for b in (None, bias):
            assert torch.equal(bits(ops.panel_linear(x, packed, n, b)), bits(ops.panel_linear(x, fp32, n, b)))
    # Rows read through a stride (a column slice, as the gate half of gate_up is passed).
    wide = torch.randn(5, 2 * k)
    assert torch.equal(ops.panel_linear(wide[:, :k], packed, n, None), ops.panel_linear(wide[:, :k], fp32, n, None))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fused_runs_of_any_width_compute_bitwise_as_fp32_panels(threads):
    """1-4 rows take 1-4 panels side by side, the width chosen so that the runs share out evenly over the threads
    (18 panels on 2 threads: three wide): every width gives the fp32 panels' bits."""
    ops = cpu_kernels()
    rng = np.random.default_rng(threads)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for n in (576, 160, 960):  # 18, 5 and 30 panels
            w = gguf_roundtrip((rng.standard_normal((n, 64)) * 0.05).astype(np.float32), "Q4_1")
            packed = cw.pack_compact(w, ops.pack_compact_panels, ops.compact_panels_match)
            fp32 = ops.pack_panels(w)
            for rows in (1, 2, 4):
                x = torch.randn(rows, 64)
                assert torch.equal(bits(ops.panel_linear(x, packed, n, None)), bits(ops.panel_linear(x, fp32, n, None)))
    finally:
        torch.set_num_threads(before)


def test_weights_that_are_not_exact_codes_keep_fp32_panels(caplog):
    ops = cpu_kernels()
    rng = np.random.default_rng(0)
    q41 = gguf_roundtrip((rng.standard_normal((64, 256)) * 0.05).astype(np.float32), "Q4_1")
    nudged = q41.clone()
    nudged[40, 100] = torch.nextafter(nudged[40, 100], torch.tensor(1.0))
    with_nan = q41.clone()
    with_nan[3, 3] = float("nan")
    q50 = gguf_roundtrip((rng.standard_normal((64, 256)) * 0.05).astype(np.float32), "Q5_0")
    for weight in (torch.randn(200, 576), nudged, with_nan, q50, torch.randn(64, 100), q41.to(torch.float64)):
        assert cw.pack_compact(weight, ops.pack_compact_panels, ops.compact_panels_match) is None
    # The packer trusts only the kernel's own rebuild: panels that it does not rebuild into the weight keep fp32,
    # with a warning. Here the packing step hands back panels with one code changed.
    def tampered(weight):
        packed = ops.pack_compact_panels(weight).clone()
        packed[1, 3, 200] ^= 1  # a 4-bit code of block (panel 1, group 3)
        return packed

    assert not ops.compact_panels_match(tampered(q41), q41)
    with caplog.at_level(logging.WARNING, logger=cw.__name__):
        assert cw.pack_compact(q41, tampered, ops.compact_panels_match) is None
    assert "did not rebuild bit for bit" in caplog.text
    assert cw.pack_compact(q41, ops.pack_compact_panels, ops.compact_panels_match) is not None
    # The check compares every value: a weight one ulp away from what the panels hold does not match.
    assert not ops.compact_panels_match(ops.pack_compact_panels(q41), nudged)


def test_prepack_picks_compact_panels_only_where_asked():
    w = gguf_roundtrip((np.random.default_rng(1).standard_normal((96, 128)) * 0.05).astype(np.float32), "Q4_1")
    assert cw.is_compact(lin.prepack(w))
    fp32 = lin.prepack(w, compact=False)
    assert fp32.dtype == torch.float32 and lin.is_panel_packed(fp32)
    assert lin.packed_bytes(lin.prepack(w), w) == 3 * 4 * cw.AFFINE4_BLOCK  # 96 x 128 fp32: 48 KiB
    assert lin.prepack(torch.randn(96, 128)).dtype == torch.float32


def test_panel_linear_rejects_malformed_compact_weights():
    ops = cpu_kernels()
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="compact packed weight must be"):
        ops.panel_linear(x, torch.zeros(1, 2, 100, dtype=torch.uint8), 32, None)
    with pytest.raises(RuntimeError, match="x has 64 features, the packed weight 96"):
        ops.panel_linear(x, torch.zeros(1, 3, cw.AFFINE4_BLOCK, dtype=torch.uint8), 32, None)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.unpack_compact_panels(torch.zeros(1, 2, cw.SYM8_BLOCK, dtype=torch.uint8), 33)


def quantize_model_weights(path, kind: str) -> None:
    """Rewrite a saved model's 2-D weights through gguf's quantize and dequantize, as an import would."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    state = load_file(file)
    for name, t in state.items():
        if t.dim() == 2:
            state[name] = gguf_roundtrip(t.numpy(), "Q8_0" if "embed" in name else kind)
    save_file(state, file, metadata={"format": "pt"})


@pytest.mark.parametrize("cache_bits", [16, 8])
def test_engine_with_compact_panels_equals_fp32_panels_bitwise(tmp_path, cache_bits, decode_layers_calls):
    path = write_tiny_model(tmp_path / "m", "llama", seed=5, hidden_size=128, intermediate_size=256, tie=True)
    quantize_model_weights(path, "Q4_1")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(3, 60))] for _ in range(8)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=5)
    outs, packed = {}, {}
    for compact in (False, True):
        llm = LLM(model=str(path), dtype="float32", block_size=8, num_kv_blocks=256, max_num_batched_tokens=64,
                  cpu_prepack_weights=True, cpu_compact_weights=compact, cache_bits=cache_bits)
        model = llm.engine.model
        linears = [m for m in model.modules() if isinstance(m, lin.Linear)]
        assert all(cw.is_compact(m.packed) == compact for m in linears)
        assert cw.is_compact(model.embed_tokens.packed_head) == compact  # the tied LM head (Q8_0)
        assert model.fused_decoder is not None
        outs[compact], packed[compact] = llm.generate(prompts, params), llm.engine.prepacked_bytes
    assert decode_layers_calls, "the decode-only steps must go through the one-call decoder"
    for a, b in zip(outs[False], outs[True], strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # exact floats
    assert packed[True] < 0.3 * packed[False]


def test_auto_packs_only_the_weights_that_compact_panels_hold(tmp_path, decode_layers_calls):
    """cpu_prepack_weights "auto" (the default): compact panels where a weight is codes times fp16 scales,
    no copy at all for any other weight, so a model with arbitrary fp32 weights costs no extra memory; a GGUF
    import gets the same panels, and bitwise the same outputs, as with cpu_prepack_weights true."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(3, 40))] for _ in range(5)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    options = {"dtype": "float32", "block_size": 8, "num_kv_blocks": 256, "max_num_batched_tokens": 64}

    plain = write_tiny_model(tmp_path / "plain", "llama", seed=7, hidden_size=128, intermediate_size=256, tie=True)
    llm = LLM(model=str(plain), **options)
    model = llm.engine.model
    assert llm.engine.config.cpu_prepack_weights == "auto"
    assert llm.engine.prepacked_bytes == 0
    assert all(m.packed is None for m in model.modules() if isinstance(m, lin.Linear))
    assert model.embed_tokens.packed_head is None and model.fused_decoder is None

    gguf = write_tiny_model(tmp_path / "gguf", "llama", seed=7, hidden_size=128, intermediate_size=256, tie=True)
    quantize_model_weights(gguf, "Q4_1")
    runs = {}
    for prepack in ("auto", True):
        llm = LLM(model=str(gguf), cpu_prepack_weights=prepack, **options)
        model = llm.engine.model
        assert all(cw.is_compact(m.packed) for m in model.modules() if isinstance(m, lin.Linear))
        assert cw.is_compact(model.embed_tokens.packed_head) and model.fused_decoder is not None
        runs[prepack] = llm.engine.prepacked_bytes, llm.generate(prompts, params)
    assert decode_layers_calls
    assert runs["auto"][0] == runs[True][0] > 0
    for a, b in zip(runs["auto"][1], runs[True][1], strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs

    # Without compact panels, "auto" packs nothing; true packs fp32 panels.
    assert LLM(model=str(gguf), cpu_compact_weights=False, **options).engine.prepacked_bytes == 0
    assert LLM(model=str(plain), cpu_prepack_weights=True, **options).engine.prepacked_bytes > 0


@pytest.mark.parametrize("prepack", ["auto", True])
def test_packing_options_leave_a_quantized_model_alone(tmp_path, prepack):
    """Weights quantized at load time (int8 linears and an int8 tied table) have their own kernels: the packing
    options give them no copies, and the model runs (it used to fail looking for the table's fp32 weight)."""
    path = write_tiny_model(tmp_path / "m", "llama", seed=8, hidden_size=128, intermediate_size=256, tie=True)
    llm = LLM(model=str(path), dtype="float32", weight_bits=8, block_size=8, num_kv_blocks=64,
              cpu_prepack_weights=prepack)
    assert llm.engine.prepacked_bytes == 0 and llm.engine.model.fused_decoder is None
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_cpu_prepack_weights_rejects_other_values(value):
    from engine.config import EngineConfig
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="cpu_prepack_weights must be true, false or 'auto'"):
        EngineConfig(cpu_prepack_weights=value)


@pytest.mark.parametrize("tie", [True, False])
def test_freed_plain_weights_are_rebuilt_where_a_path_needs_them(tmp_path, tie):
    """cpu_free_plain_weights: the fp32 weights that compact panels hold are freed (a tied embedding table too:
    token lookups rebuild their rows); prefill chunks over 256 rows (MKL) and deterministic requests (the
    batch-invariant kernel) rebuild the linears, so every output stays the same."""
    path = write_tiny_model(tmp_path / "m", "llama", seed=6, hidden_size=128, intermediate_size=256, tie=tie)
    quantize_model_weights(path, "Q4_1")
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (300, 420, 40, 7)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    invariant = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5, deterministic=True)
    runs = {}
    for free in (False, True):
        llm = LLM(model=str(path), dtype="float32", block_size=8, num_kv_blocks=512, max_num_batched_tokens=512,
                  cpu_prepack_weights=True, cpu_free_plain_weights=free)
        model = llm.engine.model
        linears = [m for m in model.modules() if isinstance(m, lin.Linear)]
        assert all(m.weight.is_meta == free for m in linears)
        # An untied table has no packed copy to rebuild rows from, so it stays.
        assert model.embed_tokens.weight.is_meta == (free and tie)
        assert model.fused_decoder is not None
        held = linears + ([model.embed_tokens] if tie else [])
        runs[free] = (llm.generate(prompts, params), llm.generate(prompts[2:], invariant), llm.engine.weight_bytes,
                      sum(m.weight.numel() * 4 for m in held))
    for a, b in zip(runs[False][0] + runs[False][1], runs[True][0] + runs[True][1], strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
    assert runs[True][2] == runs[False][2] - runs[False][3]


def test_a_freed_weight_without_compact_panels_is_a_clear_error():
    layer = lin.Linear(64, 32, bias=False)
    packed = lin.prepack(gguf_roundtrip((np.random.default_rng(2).standard_normal((32, 64)) * 0.05)
                                        .astype(np.float32), "Q8_0"))
    assert lin.free_plain_weight(layer, torch.zeros(1, 64, 32)) == 0  # fp32 panels: nothing freed
    assert lin.free_plain_weight(layer, packed) == 32 * 64 * 4 and layer.weight.is_meta
    with pytest.raises(RuntimeError, match="was freed but has no compact panels"):
        lin.linear(torch.randn(300, 64), layer.weight, packed=None)


def test_compact_rows_rebuild_embedding_rows_bit_for_bit():
    ops = cpu_kernels()
    rng = np.random.default_rng(3)
    for kind in ("Q8_0", "Q4_1"):
        table = gguf_roundtrip((rng.standard_normal((70, 96)) * 0.05).astype(np.float32), kind)
        packed = cw.pack_compact(table, ops.pack_compact_panels, ops.compact_panels_match)
        ids = torch.tensor([[0, 69, 31], [32, 5, 5]])
        assert torch.equal(bits(ops.compact_rows(packed, ids, 70)), bits(table[ids.view(-1)]))
        with pytest.raises(RuntimeError, match="row 70 outside"):
            ops.compact_rows(packed, torch.tensor([1, 70]), 70)


def test_affine_codes_rebuild_bitwise_at_extreme_scales_and_signed_offsets():
    """Q4_1's value is fl(fl(code * d) + m); the kernel computes it as one FMA, which is the same because a 4-bit
    code times an fp16 d is exact in fp32. Here at the ends of fp16 (subnormal and large d) and with offsets of
    both signs and both zeros, through the packer's check, the rebuild and every path of the kernel."""
    ops = cpu_kernels()
    rng = np.random.default_rng(11)
    scales = [2.0**-24, 2.0**-14 * 0.75, 1e-3, 0.1, 7.0, 1000.0, 65504.0]
    rows, k = 32, 64
    w = np.empty((rows, k), dtype=np.float32)
    for r in range(rows):
        for g in range(k // 32):
            d = np.float32(np.float16(scales[(r + g) % len(scales)]))
            m = np.float32(np.float16([0.0, -0.0, -7.5, 3.25][(r * 2 + g) % 4] * min(float(d), 1000.0)))
            codes = rng.integers(0, 16, 32).astype(np.float32)
            codes[:2] = (0, 15)  # the group spans the whole code range, so its scale and offset are recoverable
            w[r, g * 32:(g + 1) * 32] = (codes * d).astype(np.float32) + m  # two float32 roundings
    weight = torch.from_numpy(w)
    packed = cw.pack_compact(weight, ops.pack_compact_panels, ops.compact_panels_match)
    assert packed is not None and packed.shape[2] == cw.AFFINE4_BLOCK
    assert torch.equal(bits(ops.unpack_compact_panels(packed, rows)), bits(weight))
    assert torch.equal(bits(ops.compact_rows(packed, torch.arange(rows), rows)), bits(weight))
    fp32 = ops.pack_panels(weight)
    for n in (1, 3, 12, 20):
        x = torch.randn(n, k)
        assert torch.equal(bits(ops.panel_linear(x, packed, rows, None)), bits(ops.panel_linear(x, fp32, rows, None)))
