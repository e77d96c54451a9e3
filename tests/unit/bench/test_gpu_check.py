"""bench.gpu_check's accounting, on the CPU: the bytes a decode step reads, and a speed run's rows."""

from __future__ import annotations

import math

import torch

from bench.gpu_check import TINY, bytes_read_per_decode_step, speed_suite, write_config_only
from engine import EngineConfig, EngineCore


def test_bytes_read_per_decode_step_counts_weights_but_not_an_untied_embedding():
    engine = EngineCore(EngineConfig(model=str(write_config_only(TINY)), dtype="float32", device="cpu",
                                     load_format="dummy", max_model_len=256))
    weights, kv = bytes_read_per_decode_step(engine, [10, 20])
    # Parameters by hand for TINY (hidden 128, intermediate 256, 2 layers, 4 heads of 32, 2 KV heads,
    # vocab 512): the LM head 512*128, per layer qkv 128*256 + o 128*128 + gate_up 128*512 + down 256*128
    # + two norms of 128, and the final norm; the embedding table (512*128) is gathered, not read.
    params = 512 * 128 + 2 * (128 * 256 + 128 * 128 + 128 * 512 + 256 * 128 + 2 * 128) + 128
    assert weights == params * 4
    # K and V of 2 layers x 2 KV heads x 32 dims in fp32, for 30 rows.
    assert kv == 30 * 2 * 2 * 2 * 32 * 4


def test_speed_suite_reports_every_mode_against_the_roofline():
    bandwidth = 20e9
    result = speed_suite("tiny", write_config_only(TINY), torch.device("cpu"), "float32", True, 64, 3, (4, 1),
                         bandwidth)
    runs = result["runs"]
    assert [(r["batch"], r["mode"]) for r in runs] == [(4, "eager+pipelined"), (1, "eager+pipelined")]
    for r in runs:
        assert r["step_ms"] > 0 and r["decode_tok_s"] == r["batch"] / (r["step_ms"] / 1e3)
        assert math.isclose(r["roofline_step_ms"], (r["weight_bytes"] + r["kv_bytes"]) / bandwidth * 1e3)
        assert math.isclose(r["share_of_roofline"], r["roofline_step_ms"] / r["step_ms"])
        assert r["device_idle_ms_per_step"] is None  # measured with CUDA events only
    # Each sequence's KV at the middle of the timed steps: a 64-token prompt, 3 warm-up steps, then 3 more.
    per_row = 2 * 2 * 2 * 32 * 4
    assert runs[0]["kv_bytes"] > 4 * 64 * per_row


def _run(batch, mode, step_ms, roof_ms):
    return {"batch": batch, "mode": mode, "step_ms": step_ms, "roofline_step_ms": roof_ms,
            "share_of_roofline": roof_ms / step_ms}


def test_targets_fusion_ratios_and_merged_runs():
    import argparse

    import pytest

    from bench.gpu_check import fusion_lines, merge_reports, section_list, target_lines

    fused = {"runs": [_run(64, "graphs+pipelined", 8.0, 5.8), _run(1, "graphs+pipelined", 5.0, 3.6)]}
    plain = {"runs": [_run(64, "graphs+pipelined", 10.0, 5.8), _run(1, "graphs, synchronous", 6.0, 3.6)]}
    a = {"device": "H", "seconds": 10, "kernels": {"ok": True}, "llama3_8b_shaped": fused}
    b = {"device": "H", "seconds": 5, "llama3_8b_unfused": plain, "date": "later"}
    merged = merge_reports([a, b])
    assert merged["seconds"] == 15 and merged["llama3_8b_unfused"] is plain and "date" not in merged
    assert target_lines(merged) == [
        "target: bf16 decode at batch 64 >= 80% of the HBM roofline: 72.5% (missed)",
        "target: bf16 single-stream step within 1.2x of the roofline: 1.39x (missed)"]
    faster = {"runs": [_run(64, "graphs+pipelined", 7.0, 5.8), _run(1, "graphs+pipelined", 4.2, 3.6)]}
    assert [line.rsplit(" ", 2)[1:] for line in target_lines({"llama3_8b_shaped": faster})] == [
        ["82.9%", "(met)"], ["1.17x", "(met)"]]
    # Only the modes both decoders ran are compared.
    assert fusion_lines(merged) == ["batch 64, graphs+pipelined: 10.00 ms unfused -> 8.00 ms fused (1.25x)"]
    with pytest.raises(SystemExit):
        merge_reports([a, {**b, "device": "other"}])
    assert section_list("kernels, smollm2_speed") == ["kernels", "smollm2_speed"]
    with pytest.raises(argparse.ArgumentTypeError):
        section_list("kernels,warp_drive")


def test_sections_run_in_the_order_given_and_each_one_is_saved(monkeypatch, tmp_path):
    """A call cut off by the device's time limit keeps what it finished: the JSON is rewritten after every
    section, marked incomplete until the end, and sections past the time budget are marked skipped."""
    import argparse
    import json
    import time

    import bench.gpu_check as gc

    calls = []

    def fake(name, seconds):
        def run(*args):
            calls.append(name)
            time.sleep(seconds)
            return {"ran": name}
        return run

    def sweep(device, dtype, quick, partial):  # the longest section saves each shape as it ends
        partial({"shape 1": {"default_us": 1.0}})
        return fake("decode_sweep", 1.5)()

    monkeypatch.setattr(gc, "copy_bandwidth", lambda *a: 1e9)
    monkeypatch.setattr(gc, "decode_sweep", sweep)
    monkeypatch.setattr(gc, "check_kernels", fake("kernels", 0))
    path, saved = tmp_path / "run.json", []

    def save(report):
        gc.save_report(report, path)
        saved.append(json.loads(path.read_text()))

    args = argparse.Namespace(device="cpu", quick=True, smollm2_gguf=None, time_budget=1.0,
                              sections=["decode_sweep", "kernels"])
    report = gc.run(args, save)
    assert calls == ["decode_sweep"]  # kernels came after the budget had run out
    assert [s["complete"] for s in saved] == [False, False, False, True]
    assert saved[0]["decode_sweep"] == {"shape 1": {"default_us": 1.0}, "unfinished": True}
    assert saved[1]["decode_sweep"]["ran"] == "decode_sweep" and "kernels" not in saved[1]
    assert "budget" in saved[2]["kernels"]["skipped"]
    assert saved[-1] == json.loads(json.dumps(report, default=str)) and not list(tmp_path.glob("*.tmp"))
    args.sections, args.time_budget, calls[:] = ["kernels", "decode_sweep"], 60, []
    keys = list(gc.run(args))
    assert calls == ["kernels", "decode_sweep"] and keys.index("kernels") < keys.index("decode_sweep")


def test_report_writes_the_weight_and_kv_docs_sections_it_has_data_for(monkeypatch, tmp_path):
    import bench.report
    from bench.gpu_check import write_docs

    docs = tmp_path / "gpu.md"
    docs.write_text("intro\n<!-- gpu:start -->\nspeed rows\n<!-- gpu:end -->\n<!-- gpu-weights:start -->\nnot yet\n"
                    "<!-- gpu-weights:end -->\nnotes\n<!-- gpu-kv:start -->\nnot yet\n<!-- gpu-kv:end -->\n")
    monkeypatch.setattr(bench.report, "PERF", tmp_path)

    def run(fmt, batch, tok_s):
        return {"batch": batch, "step_ms": 1e3 * batch / tok_s, "decode_tok_s": tok_s, "prefill_tok_s": 9000.0,
                "roofline_step_ms": 1.0, "share_of_roofline": 0.75, "kv_bytes": 1}

    def engine(model, fmt, tok_s, ppl):
        return {"model": model, "format": fmt, "decode_weight_bytes": 2**30, "peak_memory_bytes": 2**31,
                "perplexity": ppl, "runs": [run(fmt, 64, tok_s[0]), run(fmt, 1, tok_s[1])]}

    from bench.gpu_weights import perplexity_targets, speedups, target_lines
    engines = [engine("llama3-8b-shaped", "bf16", (1000, 50), 1.0), engine("llama3-8b-shaped", "fp8", (1400, 85), 1.0),
               engine("smollm2", "bf16", (9000, 400), 20.0), engine("smollm2", "fp8-auto", (9500, 410), 20.1),
               {"model": "smollm2", "format": "int4", "error": "RuntimeError: boom"}]
    weights = {"engines": engines, "speedups": speedups(engines), "linears": []}
    weights["targets"] = target_lines(weights["speedups"], "llama3-8b-shaped") + perplexity_targets(engines)
    assert weights["targets"][2:] == ["target: smollm2 perplexity with fp8-auto weights <= +1% over bf16: +0.50% (met)"]
    kv = {"shape": "llama3-8b", "kv_memory_bytes": 16 << 30, "errors": {},
          "runs": [{"format": f, "context": 4096, "batch": 64, "step_ms": 1e3 * 64 / t, "decode_tok_s": t,
                    "roofline_step_ms": 20.0, "share_of_roofline": 0.8, "attention_backend": "triton",
                    "cuda_graphs": True} for f, t in (("bf16", 3000.0), ("fp8", 4200.0))],
          "concurrency": {"bf16": {"1024": 128, "4096": 32}, "fp8": {"1024": 256, "4096": 64}},
          "perplexity": [{"format": "bf16", "perplexity": 19.0, "vs_bf16": 0.0},
                         {"format": "fp8", "perplexity": 19.2, "vs_bf16": 0.2 / 19}]}
    report = {"device": "NVIDIA H200", "multiprocessors": 132, "torch": "t", "triton": "3", "date": "today",
              "copy_bandwidth_GBps": 4000.0, "weight_formats": weights, "kv_formats": kv}
    write_docs(report, ["run-b.json"])
    text = docs.read_text()
    assert "speed rows" in text and text.count("not yet") == 0 and "notes" in text  # the speed section: no data
    weights_part = text[text.index("gpu-weights:start"):text.index("gpu-weights:end")]
    assert "fp8 decode at batch 64 >= 1.3x bf16: 1.40x (met)" in weights_part
    assert "| llama3-8b-shaped | fp8 | 1 | 11.76 | 85 | 1.70x |" in weights_part
    assert "smollm2 int4: RuntimeError: boom" in weights_part and "--report run-b.json" in weights_part
    kv_part = text[text.index("gpu-kv:start"):text.index("gpu-kv:end")]
    assert "fp8 KV decode at context 4096, batch 64 >= 1.3x bf16 KV: 1.40x (met)" in kv_part
    assert "fp8 KV holds >= 2x the sequences of bf16 KV in the same memory (context 4096): 2.00x (met)" in kv_part
    assert "perplexity with fp8 KV <= +0.5% over bf16 KV: +1.05% (missed)" in kv_part
    assert "| fp8 | 256 | 64 |" in kv_part and "| fp8 | 4096 | 64 | 15.24 | 4200 | 1.40x |" in kv_part
    # A section that failed on the device leaves the docs' text as it was.
    report["kv_formats"] = {"error": "RuntimeError: no fp8"}
    write_docs(report, ["run-c.json"])
    assert docs.read_text().count("run-c.json") == 1  # the weights part only


def test_l2_copies_cover_three_times_the_l2_and_in_turn_rotates(monkeypatch):
    """Kernel rows time launches replayed back to back; rotating over copies of the inputs keeps each launch's
    reads out of the L2 cache that the previous launches filled."""
    import types

    from bench.gpu_check import in_turn, l2_copies

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(L2_cache_size=50 << 20))
    cuda = torch.device("cuda")
    assert l2_copies(cuda, 4 << 20) == 38 and l2_copies(cuda, 50 << 20) == 3 and l2_copies(cuda, 1 << 30) == 1
    assert l2_copies(torch.device("cpu"), 1) == 1
    seen = []
    call = in_turn([lambda i=i: seen.append(i) for i in range(3)])
    for _ in range(7):
        call()
    assert seen == [0, 1, 2, 0, 1, 2, 0]


def _toy_kernel(x_ptr, n, BLOCK):
    pass


def test_compiled_kernels_reads_each_loaded_variant_of_the_engines_kernels(monkeypatch):
    import sys
    import types
    from types import SimpleNamespace

    from triton.runtime.jit import JITFunction

    from bench.gpu_check import compiled_kernels

    fn = JITFunction(_toy_kernel)

    def build(regs, spills, warps, block):
        return SimpleNamespace(n_regs=regs, n_spills=spills, metadata=SimpleNamespace(num_warps=warps, num_stages=3),
                               src=SimpleNamespace(constants={(2,): block}))

    unloaded = SimpleNamespace(n_regs=None)  # compiled, never launched: no device figures to read
    fn.device_caches[0] = ({"a": build(145, 0, 4, 64), "b": build(80, 8, 8, 32), "c": unloaded}, None, None, None,
                           None)
    engine_side = types.ModuleType("engine.toy_kernels")
    engine_side.kernel = engine_side.alias = fn  # one kernel under two names is read once
    elsewhere = types.ModuleType("toy_elsewhere")
    elsewhere.kernel = JITFunction(_toy_kernel)
    elsewhere.kernel.device_caches[0] = ({"a": build(1, 0, 1, 1)}, None, None, None, None)
    monkeypatch.setitem(sys.modules, "engine.toy_kernels", engine_side)
    monkeypatch.setitem(sys.modules, "toy_elsewhere", elsewhere)
    rows = [r for r in compiled_kernels() if r["kernel"] == "_toy_kernel"]
    assert rows == [
        {"kernel": "_toy_kernel", "constexprs": {"BLOCK": 64}, "warps": 4, "stages": 3, "registers": 145, "spills": 0},
        {"kernel": "_toy_kernel", "constexprs": {"BLOCK": 32}, "warps": 8, "stages": 3, "registers": 80, "spills": 8},
    ]
