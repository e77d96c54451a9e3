"""fp8 checkpoints other tools publish, loaded as they are: compressed-tensors (per channel, per tensor)
and block-wise fp8 (`weight_scale_inv` per block), each written here from a tiny random Llama and
compared with the same weights dequantized into a plain fp32 folder; and `infinilm quantize --format
fp8`, whose compressed-tensors output loads back bit for bit."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from cli import app
from engine import LLM, SamplingParams
from engine.errors import ModelLoadError
from engine.models.config import ModelConfig
from engine.quant.fp8 import Fp8Linear
from engine.quant.hf_fp8 import compressed_tensors_config
from engine.quant.modules import Int8Linear
from engine.quant.quantizers import FP8_DTYPE, FP8_MAX

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
PROMPTS = [[5, 40, 77, 120, 9, 33], [200, 3, 3, 18]]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = (48, 48)  # does not divide the tiny widths (64, 128): partial blocks at the edges


def _quantize(w: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, the checkpoint's scale tensor, the weight they stand for) in one of the layouts."""
    w = w.float()
    n, k = w.shape
    if layout == "channel":
        scale = (w.abs().amax(1, keepdim=True) / FP8_MAX)
        full = scale.expand(n, k)
    elif layout == "tensor":
        scale = (w.abs().amax() / FP8_MAX).reshape(1)
        full = scale.expand(n, k)
    else:
        bn, bk = BLOCK
        scale = torch.empty(-(-n // bn), -(-k // bk))
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                scale[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().amax() / FP8_MAX
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    codes = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale, codes.float() * full


def write_fp8_pair(src, tmp_path, layout: str):
    """(the fp8 folder in `layout`, a plain folder with the weights it stands for, in fp32)."""
    fp8_dir, ref_dir = tmp_path / f"fp8-{layout}", tmp_path / f"ref-{layout}"
    for d in (fp8_dir, ref_dir):
        shutil.copytree(src, d)
    state = load_file(src / "model.safetensors")
    fp8_state, ref_state = {}, {}
    for name, tensor in state.items():
        if name.rpartition(".")[0].rpartition(".")[2] in LINEARS and name.endswith(".weight"):
            codes, scale, value = _quantize(tensor, layout)
            prefix = name.rpartition(".")[0]
            fp8_state[name] = codes
            fp8_state[f"{prefix}.weight_scale_inv" if layout == "block" else f"{prefix}.weight_scale"] = scale
            fp8_state[f"{prefix}.input_scale"] = torch.ones(1)  # static scales are not read
            ref_state[name] = value
        else:
            fp8_state[name] = ref_state[name] = tensor
    save_file(fp8_state, fp8_dir / "model.safetensors")
    save_file(ref_state, ref_dir / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    if layout == "block":
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                         "weight_block_size": list(BLOCK)}
    else:
        config["quantization_config"] = compressed_tensors_config(["lm_head"])
        config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = layout
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return fp8_dir, ref_dir


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["channel", "tensor", "block"])
def test_fp8_checkpoint_matches_its_dequantized_weights(tiny_llama, tmp_path, layout):
    fp8_dir, ref_dir = write_fp8_pair(tiny_llama, tmp_path, layout)
    fp8 = LLM(model=str(fp8_dir), dtype="float32", weight_bits=8, weight_format="fp8")
    ref = LLM(model=str(ref_dir), dtype="float32")
    for ours, theirs in zip(fp8.engine.model.layers, ref.engine.model.layers, strict=True):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            layer, want = ours.get_submodule(name), theirs.get_submodule(name).weight
            assert isinstance(layer, Fp8Linear)
            if layout == "block":  # requantized per channel at load: one more E4M3 rounding
                assert ((layer.dequantize() - want).abs() <= want.abs() * 2**-4 + 1e-6).all()
            else:  # channel and tensor scales map onto per-channel ones exactly
                assert torch.equal(layer.dequantize(), want)
    for a, b in zip(ref.generate(PROMPTS, GREEDY), fp8.generate(PROMPTS, GREEDY), strict=True):
        assert a.token_ids[:3] == b.token_ids[:3]
        assert max(abs(s[0] - t[0]) for s, t in zip(a.logprobs[:3], b.logprobs[:3], strict=True)) < 0.02
    # Where int8 is the fast path (auto on the CPU), the fp8 weights are requantized to int8 at load.
    auto = LLM(model=str(fp8_dir), dtype="float32")
    assert isinstance(auto.engine.model.layers[0].mlp.down_proj, Int8Linear)
    assert len(auto.generate(PROMPTS[:1], GREEDY)[0].token_ids) == GREEDY.max_tokens


def test_unsupported_fp8_checkpoints_fail_with_a_reason(tiny_llama, tmp_path):
    fp8_dir, _ = write_fp8_pair(tiny_llama, tmp_path, "channel")
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "int"
    (fp8_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="only 8-bit float"):
        LLM(model=str(fp8_dir), dtype="float32", weight_bits=8, weight_format="fp8")
    config["quantization_config"] = {"quant_method": "awq"}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported quantization method 'awq'"):
        ModelConfig.from_folder(fp8_dir)


@pytest.mark.slow
def test_quantize_format_fp8_writes_compressed_tensors_that_load_back(tiny_llama, tmp_path):
    out = tmp_path / "fp8"
    result = CliRunner().invoke(app, ["quantize", "--model", str(tiny_llama), "--out", str(out), "--format", "fp8"])
    assert result.exit_code == 0, result.output
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qconfig["quant_method"] == "compressed-tensors" and qconfig["format"] == "float-quantized"
    assert qconfig["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    assert json.loads((out / "infinilm_quantization.json").read_text())["calibrated"] is True
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        q = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
        assert q.dtype == FP8_DTYPE and q.shape == (32, 64)  # 2 KV heads of 16
        assert f.get_tensor("model.layers.0.self_attn.k_proj.weight_scale").shape == (32, 1)
        assert f.get_tensor("lm_head.weight").dtype == torch.float32
    assert "model.layers.1.mlp.up_proj.weight_scale" in names and not any("qkv" in n for n in names)
    saved = LLM(model=str(out), dtype="float32", weight_bits=8, weight_format="fp8")
    live = LLM(model=str(tiny_llama), dtype="float32", weight_bits=8, weight_format="fp8")
    for x, y in zip(saved.generate(PROMPTS, GREEDY), live.generate(PROMPTS, GREEDY), strict=True):
        assert x.token_ids == y.token_ids
        assert [s[0] for s in x.logprobs] == [s[0] for s in y.logprobs]
    bad = CliRunner().invoke(app, ["quantize", "--model", str(tiny_llama), "--out", str(tmp_path / "b"),
                                   "--format", "fp8", "--bits", "4"])
    assert bad.exit_code == 1 and "--format fp8 is 8 bits" in bad.output
