"""`infinilm quantize` writes a checkpoint the engine loads back exactly; `infinilm eval ppl` scores
text; the worker config reaches the engine's quantization and memory settings."""

from __future__ import annotations

import json
import re

import pytest
import torch
from typer.testing import CliRunner

from cli import app
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.kv_cache import bytes_per_block, plan_cache_layout
from engine.models.config import ModelConfig
from engine.quant.modules import Int4Linear, Int8Linear, QuantizedEmbedding

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
PROMPTS = [[5, 40, 77, 120, 9, 33], [200, 3, 3, 18]]
runner = CliRunner()


def quantize(src, out, *extra: str):
    return runner.invoke(app, ["quantize", "--model", str(src), "--out", str(out), *extra])


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_then_load_equals_load_time_quantization(tiny_llama, tmp_path, bits):
    out = tmp_path / f"q{bits}"
    result = quantize(tiny_llama, out, "--bits", str(bits), "--group-size", "64")
    assert result.exit_code == 0, result.output
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qconfig["quant_method"] == "infinilm" and qconfig["bits"] == bits and qconfig["calibrated"]
    assert ModelConfig.from_folder(out).quantization == qconfig

    saved = LLM(model=str(out), dtype="float32")
    live = LLM(model=str(tiny_llama), dtype="float32", weight_bits=bits, weight_group_size=64)
    fp = LLM(model=str(tiny_llama), dtype="float32")
    kind = Int8Linear if bits == 8 else Int4Linear
    assert isinstance(saved.engine.model.layers[0].mlp.down_proj, kind)
    assert isinstance(saved.engine.model.embed_tokens, QuantizedEmbedding)
    # Same weights bit for bit, so the same logprobs; and far fewer bytes than fp32.
    a, b = saved.generate(PROMPTS, GREEDY), live.generate(PROMPTS, GREEDY)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert [s[0] for s in x.logprobs] == [s[0] for s in y.logprobs]
    assert saved.engine.weight_bytes < (0.3 if bits == 8 else 0.2) * fp.engine.weight_bytes


def test_quantize_rejects_bad_input(tiny_llama, tmp_path):
    bad_bits = quantize(tiny_llama, tmp_path / "a", "--bits", "3")
    assert bad_bits.exit_code == 1 and "--bits must be 8 or 4" in bad_bits.output
    missing = quantize(tiny_llama, tmp_path / "b", "--bits", "8", "--calib", str(tmp_path / "nope.txt"))
    # click's usage error comes in a rich panel that wraps long paths; compare the words, not the layout.
    assert missing.exit_code == 2 and "does not exist" in " ".join(re.sub("[│╭╮╰╯─]", " ", missing.output).split())
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    busy = quantize(tiny_llama, tmp_path / "full", "--bits", "8")
    assert busy.exit_code == 1 and "--force" in busy.output
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    bad_jsonl = tmp_path / "calib.jsonl"
    bad_jsonl.write_text('{"text": "fine"}\nnot json\n')
    broken = quantize(tiny_llama, tmp_path / "c", "--bits", "8", "--calib", str(bad_jsonl))
    assert broken.exit_code == 1 and "calib.jsonl:2: not JSON" in broken.output
    binary = tmp_path / "calib.txt"
    binary.write_bytes(b"text, then \xd0\x00 bytes of a binary")
    refused = quantize(tiny_llama, tmp_path / "d", "--bits", "8", "--calib", str(binary))
    assert refused.exit_code == 1 and "calib.txt is not UTF-8 text (byte 0xd0 at offset 11)" in refused.output
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())


def test_uncalibrated_quantization_is_marked_and_differs_from_calibrated(tiny_llama, tmp_path):
    assert quantize(tiny_llama, tmp_path / "rtn", "--bits", "8", "--no-calibrate").exit_code == 0
    assert quantize(tiny_llama, tmp_path / "cal", "--bits", "8").exit_code == 0
    rtn = json.loads((tmp_path / "rtn" / "config.json").read_text())["quantization_config"]
    assert rtn["calibrated"] is False and rtn["calibration"] is None
    from safetensors.torch import load_file

    a = load_file(tmp_path / "rtn" / "model.safetensors")
    b = load_file(tmp_path / "cal" / "model.safetensors")
    assert any(not torch.equal(a[k], b[k]) for k in a if k.endswith("scales"))


@pytest.mark.slow
def test_eval_ppl_reports_json(tiny_llama, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 12)
    result = runner.invoke(app, ["eval", "ppl", "--model", str(tiny_llama), "--text", str(text), "--context", "128",
                                 "--stride", "64", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert report["tokens_scored"] == len(text.read_text()) - 1  # one token per byte, all but the first
    assert 1 < report["perplexity"] < 320  # better than nothing, no better than certain
    bad = runner.invoke(app, ["eval", "ppl", "--model", str(tiny_llama), "--text", str(text), "--quant", "5"])
    assert bad.exit_code == 1 and "--quant must be 16, 8 or 4" in bad.output
    text.write_bytes(b"\x7fELF\x02\x01\x01\x00\xff")  # a binary would be scored as replacement characters
    binary = runner.invoke(app, ["eval", "ppl", "--model", str(tiny_llama), "--text", str(text)])
    assert binary.exit_code == 1 and "t.txt is not UTF-8 text (byte 0xff at offset 8)" in binary.output


def test_max_cache_ratio_bounds_the_pool_and_int8_fits_more_blocks():
    from engine.model_registry import resolve_model

    mc = ModelConfig.from_folder(resolve_model("smollm2"))  # head_dim 64, as the concurrency target assumes
    budget = 256 << 20
    layouts = {}
    for bits in (16, 8):
        cfg = EngineConfig(cpu_memory_bytes=budget, max_cache_ratio=0.25, cache_bits=bits, block_size=16)
        layout = plan_cache_layout(cfg, mc, torch.device("cpu"), torch.bfloat16)
        assert layout.num_blocks * layout.bytes_per_block <= budget * 0.25
        assert layout.bytes_per_block == bytes_per_block(mc, 16, torch.bfloat16, bits)
        layouts[bits] = layout
    # int8 rows cost head_dim + 2 bytes against 2 * head_dim in bf16.
    assert layouts[8].num_blocks >= 1.9 * layouts[16].num_blocks
    with pytest.raises(Exception, match="KV budget"):
        plan_cache_layout(EngineConfig(cpu_memory_bytes=1 << 16, max_cache_ratio=0.5), mc, torch.device("cpu"),
                          torch.float32)


def test_worker_config_maps_quantization_and_memory_keys(tmp_path):
    from worker.config import load_config
    from worker.config_types import ConfigError

    calib = tmp_path / "calib.txt"
    calib.write_text("calibration text")
    config = tmp_path / "c.yaml"
    config.write_text(f"""
memory: {{max_cache_ratio: 0.3, cpu_memory_bytes: 1GiB, embedding_offload: true}}
quantization: {{weight_bits: 4, weight_group_size: 64, cache_bits: 8, kv_fp_window: 32, calibration_file: {calib}}}
""")
    engine = load_config(config, env={}).engine_config()
    assert (engine.max_cache_ratio, engine.cpu_memory_bytes, engine.embedding_offload) == (0.3, 1 << 30, True)
    assert (engine.weight_bits, engine.weight_group_size, engine.cache_bits, engine.kv_fp_window) == (4, 64, 8, 32)
    assert engine.calibration_file == str(calib)
    config.write_text("quantization: {kv_fp_window: 8}\n")
    with pytest.raises(ConfigError, match="kv_fp_window"):
        load_config(config, env={})
