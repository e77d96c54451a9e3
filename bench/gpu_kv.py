"""KV-cache formats on the device: bf16 (the model dtype), fp8 and int8 (cache_bits: 8), side by side.

    python -m bench.gpu_check --sections kv_formats     # a section of the device check
    python -m bench.gpu_kv                              # alone, on a CUDA machine
    python -m bench.gpu_kv --device cpu --quick         # the same logic on the CPU, small shapes

Rows, on the 8B shape with random weights: a decode step's time at each context and batch, and its
share of the HBM roofline on the bytes the step actually reads (the weights, and each sequence's K/V
in the format's bytes: int8 codes plus their fp16 scales, fp8 codes); the most sequences of that
context the same KV memory holds in each format; SmolLM2's perplexity with each format when its
weights are at hand. A format the device cannot run (fp8 below compute capability 8.9) reports why.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import time
from pathlib import Path

import torch

FORMATS = {"bf16": {"cache_bits": 16}, "fp8": {"cache_bits": 8, "cache_format": "fp8"},
           "int8": {"cache_bits": 8, "cache_format": "int8"}}
KV_MEMORY_BYTES = 16 << 30  # the pool the concurrency column shares out (quick: 64 MiB)
PPL_TEXT = Path("/usr/share/common-licenses/GPL-3")


def kv_bytes_per_token(mc, fmt: str, dtype: torch.dtype) -> int:
    """K and V of one token over every layer, as the pool stores them in `fmt`."""
    from engine.kv_cache import bytes_per_block

    opts = FORMATS[fmt]
    return bytes_per_block(mc, 1, dtype, opts["cache_bits"], opts.get("cache_format", "int8"))


def max_sequences(mc, fmt: str, dtype: torch.dtype, memory: int, context: int, block_size: int = 16) -> int:
    """Sequences of `context` tokens whose K/V fit `memory` bytes of pool (whole blocks each)."""
    blocks = -(-context // block_size)
    return memory // (blocks * block_size * kv_bytes_per_token(mc, fmt, dtype))


def step_rows(path: Path, device: torch.device, dtype: str, fmt: str, contexts: tuple[int, ...],
              batches: tuple[int, ...], steps: int, bandwidth: float) -> list[dict]:
    """Decode step times for one format: `batches` sequences at each of `contexts` tokens."""
    from bench.gpu_check import sync
    from engine import EngineConfig, EngineCore, SamplingParams
    from engine.models.config import ModelConfig

    # A pool that holds the largest batch at the longest context in every format (the default ratio of
    # device memory would not hold 64 x 4k tokens of bf16 KV next to the 8B weights on an 80 GB GPU).
    longest = max(contexts) + steps + 32
    pool = int(max(batches) * longest * kv_bytes_per_token(ModelConfig.from_folder(path), fmt,
                                                           getattr(torch, dtype)) * 1.05)
    cfg = EngineConfig(model=str(path), dtype=dtype, device=str(device), load_format="dummy",
                       max_num_seqs=max(batches), max_num_batched_tokens=4096, cuda_graphs=True,
                       max_model_len=longest, enable_prefix_caching=False, kv_cache_memory_bytes=pool,
                       **FORMATS[fmt])
    engine = EngineCore(cfg)
    mc, vocab = engine.model_config, engine.model_config.vocab_size
    row_bytes = kv_bytes_per_token(mc, fmt, engine.dtype)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for context in contexts:
        for batch in batches:
            ids = [f"c{context}b{batch}-{i}" for i in range(batch)]
            for rid in ids:
                engine.add_request(rid, torch.randint(3, vocab, (context,), generator=gen).tolist(),
                                   SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True))
            while any(engine.scheduler.requests[r].num_computed_tokens < context for r in ids):
                engine.step()
            for _ in range(3):
                engine.step()
            sync(device)
            lens = [engine.scheduler.requests[r].num_tokens for r in ids]
            t = time.perf_counter()
            for _ in range(steps):
                engine.step()
            sync(device)
            step_s = (time.perf_counter() - t) / steps
            weights = _weight_bytes(engine)
            kv = sum(n + steps // 2 for n in lens) * row_bytes
            rows.append({"format": fmt, "context": context, "batch": batch, "step_ms": step_s * 1e3,
                         "decode_tok_s": batch / step_s, "weight_bytes": weights, "kv_bytes": kv,
                         "roofline_step_ms": (weights + kv) / bandwidth * 1e3,
                         "share_of_roofline": (weights + kv) / bandwidth / step_s,
                         "cuda_graphs": engine.runner.graphs is not None,
                         "attention_backend": engine.model.layers[0].self_attn.backend.name})
            for rid in ids:
                engine.abort_request(rid)
            while engine.has_unfinished_requests():
                engine.step()
    return rows


def _weight_bytes(engine) -> int:
    """bytes_read_per_decode_step's weight count, which reads a plain KV tensor's element size."""
    model = engine.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        weights -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return weights


def perplexity_rows(path: Path | None, device: torch.device, dtype: str, tokens: int, context: int) -> list[dict]:
    from engine import LLM
    from engine.perplexity import perplexity

    if path is None:
        return [{"skipped": "SmolLM2's weights are not on this machine (pass --smollm2-gguf)"}]
    rows = []
    for fmt, opts in FORMATS.items():
        try:
            llm = LLM(str(path), dtype=dtype, device=str(device), max_model_len=context + 1,
                      max_num_batched_tokens=max(2048, context + 1), enable_prefix_caching=False, **opts)
            ids = llm.tokenizer.encode(PPL_TEXT.read_text())[:tokens]
            r = perplexity(llm, ids, context, context // 2)
            rows.append({"format": fmt, "perplexity": r.perplexity, "tokens": r.num_scored, "context": context})
        except Exception as exc:  # fp8 on a device without it: say so, keep the other formats
            rows.append({"format": fmt, "error": f"{type(exc).__name__}: {exc}"})
    base = next((r["perplexity"] for r in rows if r.get("format") == "bf16" and "perplexity" in r), None)
    for r in rows:
        if base and "perplexity" in r:
            r["vs_bf16"] = r["perplexity"] / base - 1
    return rows


def row_bytes(fmt: str, head_dim: int, element_size: int) -> int:
    """Bytes a decode kernel reads per cached K or V row of one KV head: int8 codes carry an fp16 scale each,
    fp8's scales are per layer and head."""
    return {"bf16": element_size * head_dim, "int8": head_dim + 2, "fp8": head_dim}[fmt]


def decode_kernels(device: torch.device, bandwidth: float, quick: bool = False) -> dict:
    """The paged decode kernels alone on the 8B shape's attention (32 heads, 8 KV heads of 128): bf16
    (triton_kernels.paged_decode) against int8 and fp8 (triton_kvq.paged_decode_quant), each checked
    against bf16, timed on CUDA, with GB/s and the roofline share on the bytes each one reads."""
    from bench.gpu_check import device_ms, in_turn, l2_copies, random_decode_batch
    from engine.attention.triton_kernels import paged_decode
    from engine.attention.triton_kvq import paged_decode_quant

    h, kvh, d, bs = (4, 2, 32, 16) if quick else (32, 8, 128, 16)
    shapes = [(2, 48)] if quick else [(b, c) for c in (1024, 4096) for b in (1, 16, 64)]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for batch, context in shapes:
        q, kv, tables, lens = random_decode_batch(batch, h, kvh, d, context, bs, device, dtype, gen)
        want = paged_decode(q, kv, tables, lens, d**-0.5).float()
        for fmt in ("bf16", "int8", "fp8"):
            if fmt == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
                continue
            nbytes = 2 * batch * context * kvh * row_bytes(fmt, d, kv.element_size())
            launches = []  # over copies of the cache, so that a graph's back-to-back launches read HBM, not L2
            for i in range(l2_copies(device, nbytes)):
                if fmt == "bf16":
                    launches.append(functools.partial(paged_decode, q, kv if i == 0 else kv.clone(), tables, lens,
                                                      d**-0.5))
                    continue
                launches.append(functools.partial(paged_decode_quant, q, quant_cache(kv, fmt), tables, lens,
                                                  d**-0.5))
            err = (launches[0]().float() - want).abs().max().item()
            us, how = float("nan"), None
            if device.type == "cuda":
                ms, how = device_ms(in_turn(launches))
                us = ms * 1e3
            rows.append({"format": fmt, "batch": batch, "context": context, "us": us, "timing": how,
                         "cache_copies": len(launches), "kv_bytes": nbytes,
                         "GBps": nbytes / (us * 1e-6) / 1e9 if us == us else None,
                         "share_of_roofline": nbytes / bandwidth / (us * 1e-6) if us == us else None,
                         "max_abs_error_vs_bf16": err})
            del launches
    return {"rows": rows}


def quant_cache(kv: torch.Tensor, fmt: str):
    """An Int8KVCache in `fmt` holding the codes of a [2, blocks, bs, kvh, d] pool's every row."""
    from engine.attention.kv_int8 import Int8KVCache, write_int8

    _, nb, bs, kvh, d = kv.shape
    cache = Int8KVCache.allocate(nb, bs, kvh, d, 0, 1, kv.dtype, kv.device, fmt)
    write_int8(cache, kv[0].reshape(-1, kvh, d), kv[1].reshape(-1, kvh, d), torch.arange(nb * bs, device=kv.device))
    return cache


def quant_sweep(device: torch.device, dtype: torch.dtype, gen: torch.Generator, quick: bool = False) -> dict:
    """The 8-bit KV kernels' launch settings, as bench.gpu_check's decode_sweep times bf16's: decode at issue
    #45's fp8 target shape (8B, batch 64, 4k context) over keys per iteration, warps and pipeline stages,
    and with the query group padded to 16 rows (as before group_rows); prefill of one 4k prompt over keys
    per iteration and warps; each checked against the default launch.
    Both run without the full-precision window (kv_fp_window 0, the default)."""
    from bench.gpu_check import random_decode_batch, sweep_result, time_variants
    from engine.attention.metadata import PrefillSpan
    from engine.attention.triton_kvq import paged_decode_quant, paged_prefill_quant, quant_prefill_launch

    h, kvh, d, bs = (4, 2, 32, 16) if quick else (32, 8, 128, 16)
    batch, context, shape = (4, 100, "tiny") if quick else (64, 4096, "llama3-8b")
    q, kv, tables, lens = random_decode_batch(batch, h, kvh, d, context, bs, device, dtype, gen)
    prompt = torch.randn(context, h, d, generator=gen).to(device, dtype)
    span = PrefillSpan(token_start=0, num_tokens=context, num_cached=0, block_table=tables[0])
    scale = d**-0.5
    results = {}
    for fmt in ("int8", "fp8"):
        if fmt == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            continue
        cache = quant_cache(kv, fmt)
        kv_bytes = 2 * batch * context * kvh * row_bytes(fmt, d, kv.element_size())
        want = paged_decode_quant(q, cache, tables, lens, scale).float()
        # The bf16 sweep's keys, warps and stages (docs/perf/gpu.md gives the registers of each).
        settings = [dict(pages=p, num_warps=w, num_stages=st)
                    for p, w, st in itertools.product((1, 2, 4, 8), (4, 8), (2, 3))]
        settings += [dict(pages=p, num_warps=w, group_rows=16) for p, w in itertools.product((2, 4), (4, 8))]
        launch = functools.partial(paged_decode_quant, q, cache, tables, lens, scale)
        results[f"{fmt} {shape} b={batch} {context}"] = sweep_result(
            launch, time_variants(launch, settings, want, device, "GBps", kv_bytes / 1e9), kv_bytes, device)
        want = paged_prefill_quant(prompt, cache, [span], scale).float()
        # The span's tables built once, as the engine does per step: a launch that copies them to the device
        # cannot be captured in the timing graph.
        launch = functools.partial(paged_prefill_quant, prompt, cache, [span], scale,
                                   launch=quant_prefill_launch([span], device))
        settings = [dict(keys=k, num_warps=w) for k, w in itertools.product((32, 64), (4, 8))]
        results[f"prefill {fmt} {shape} {context}"] = sweep_result(
            launch, time_variants(launch, settings, want, device, "tok_s", context), None, device)
        del cache
    return results


def kv_formats(device: torch.device, bandwidth: float, quick: bool = False, smollm2: Path | None = None) -> dict:
    """The section bench.gpu_check runs: step rows per format, concurrency, perplexity."""
    from bench.gpu_check import LLAMA3_8B, TINY, write_config_only
    from engine.models.config import ModelConfig

    dtype = "bfloat16" if device.type == "cuda" else "float32"
    shape = TINY if quick else LLAMA3_8B
    path = write_config_only(shape)
    contexts, batches = ((48, 96), (1, 4)) if quick else ((1024, 4096), (1, 16, 64))
    mc = ModelConfig.from_folder(path)
    memory = (64 << 20) if quick else KV_MEMORY_BYTES
    result: dict = {"shape": "tiny" if quick else "llama3-8b", "kv_memory_bytes": memory, "runs": [],
                    "concurrency": {}, "errors": {}}
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        try:
            result["decode_kernels"] = decode_kernels(device, bandwidth, quick)
        except Exception as exc:
            result["errors"]["decode_kernels"] = f"{type(exc).__name__}: {exc}"
    for fmt in FORMATS:
        result["concurrency"][fmt] = {c: max_sequences(mc, fmt, getattr(torch, dtype), memory, c) for c in contexts}
        try:
            result["runs"] += step_rows(path, device, dtype, fmt, contexts, batches, 4 if quick else 32, bandwidth)
        except Exception as exc:  # one format failing must not hide the others
            result["errors"][fmt] = f"{type(exc).__name__}: {exc}"
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["perplexity"] = perplexity_rows(smollm2, device, dtype, 256 if quick else 4096, 128 if quick else 1024)
    print_kv_formats(result)
    return result


# Issue #45's KV targets: fp8 decode at (context, batch) over bf16's; sequences in the same memory; perplexity.
FP8_SPEEDUP = ((4096, 64), 1.3)
CONCURRENCY = 2.0
PPL_BOUND = 0.005


def target_lines(result: dict) -> list[str]:
    """The issue's KV targets, from whichever of their rows this run has."""
    lines = []
    tok_s = {(r["format"], r["context"], r["batch"]): r["decode_tok_s"] for r in result.get("runs", [])}
    (context, batch), want = FP8_SPEEDUP
    if ("fp8", context, batch) in tok_s and ("bf16", context, batch) in tok_s:
        got = tok_s["fp8", context, batch] / tok_s["bf16", context, batch]
        lines.append(f"target: fp8 KV decode at context {context}, batch {batch} >= {want}x bf16 KV: {got:.2f}x "
                     f"({'met' if got >= want else 'missed'})")
    # JSON turns the contexts into strings; the longest context is the one a pool is sized for.
    seqs = {fmt: {int(c): n for c, n in by_ctx.items()} for fmt, by_ctx in result.get("concurrency", {}).items()}
    if seqs.get("bf16"):
        longest = max(seqs["bf16"])
        for fmt in ("fp8", "int8"):
            if longest in seqs.get(fmt, {}):
                got = seqs[fmt][longest] / seqs["bf16"][longest]
                lines.append(f"target: {fmt} KV holds >= {CONCURRENCY:g}x the sequences of bf16 KV in the same memory "
                             f"(context {longest}): {got:.2f}x ({'met' if got >= CONCURRENCY else 'missed'})")
    for r in result.get("perplexity", []):
        if r.get("format") in ("fp8", "int8") and "vs_bf16" in r:
            lines.append(f"target: SmolLM2 perplexity with {r['format']} KV <= +{PPL_BOUND:.1%} over bf16 KV: "
                         f"{r['vs_bf16']:+.2%} ({'met' if r['vs_bf16'] <= PPL_BOUND else 'missed'})")
    return lines


def docs_body(result: dict) -> str:
    """The markdown of a device run's kv_formats section: the targets, then its rows."""
    from bench.report import markdown_table

    tok_s = {(r["format"], r["context"], r["batch"]): r["decode_tok_s"] for r in result.get("runs", [])}
    steps = [(r["format"], r["context"], r["batch"], f"{r['step_ms']:.2f}", f"{r['decode_tok_s']:.0f}",
              f"{r['decode_tok_s'] / tok_s['bf16', r['context'], r['batch']]:.2f}x"
              if ("bf16", r["context"], r["batch"]) in tok_s else "—",
              f"{r['roofline_step_ms']:.2f}", f"{r['share_of_roofline']:.0%}", r["attention_backend"],
              r["cuda_graphs"]) for r in result.get("runs", [])]
    kernels = [(r["format"], r["context"], r["batch"], f"{r['us']:.1f}",
                "—" if r["GBps"] is None else f"{r['GBps']:.0f}",
                "—" if r["share_of_roofline"] is None else f"{r['share_of_roofline']:.0%}",
                f"{r['max_abs_error_vs_bf16']:.2g}") for r in (result.get("decode_kernels") or {}).get("rows", [])]
    seqs = [(fmt, *(by_ctx.values())) for fmt, by_ctx in result.get("concurrency", {}).items()]
    contexts = next(iter(result.get("concurrency", {}).values()), {})
    ppl = [(r.get("format", ""), f"{r['perplexity']:.4f}" if "perplexity" in r else r.get("error") or r.get("skipped"),
            f"{r['vs_bf16']:+.2%}" if "vs_bf16" in r else "—") for r in result.get("perplexity", [])]
    return "\n\n".join(filter(None, [
        "\n".join(f"- {line}" for line in target_lines(result)) or "- no target's rows ran",
        "\n".join(f"- {fmt}: {err}" for fmt, err in result.get("errors", {}).items()),
        markdown_table(f"Decode steps by KV format, {result.get('shape')} shape: the roofline share on the weights and "
                       "the KV bytes a step reads", ["KV", "context", "batch", "step ms", "tok/s", "over bf16 KV",
                                                     "roofline ms", "share", "backend", "CUDA graphs"], steps)
        if steps else "",
        markdown_table("The paged decode kernels alone (32 heads, 8 KV heads of 128)",
                       ["KV", "context", "batch", "us", "GB/s", "roofline share", "max error vs bf16"], kernels)
        if kernels else "",
        markdown_table(f"Sequences in {result.get('kv_memory_bytes', 0) >> 30} GiB of KV",
                       ["KV", *(f"context {c}" for c in contexts)], seqs) if seqs else "",
        markdown_table("SmolLM2 perplexity by KV format (GPL-3, 4096 tokens, windows of 1024)",
                       ["KV", "perplexity", "over bf16 KV"], ppl) if ppl else "",
    ]))


def print_kv_formats(result: dict) -> None:
    print(f"{'format':6} {'ctx':>5} {'batch':>5} {'step ms':>8} {'tok/s':>9} {'roof ms':>8} {'roof %':>6} {'graphs':>6}")
    for r in result.get("runs", []):
        print(f"{r['format']:6} {r['context']:5d} {r['batch']:5d} {r['step_ms']:8.2f} {r['decode_tok_s']:9.1f} "
              f"{r['roofline_step_ms']:8.2f} {r['share_of_roofline']:6.1%} {r['cuda_graphs']!s:>6}")
    for r in (result.get("decode_kernels") or {}).get("rows", []):
        share = "-" if r["share_of_roofline"] is None else f"{r['share_of_roofline']:.1%}"
        print(f"decode kernel {r['format']:5} ctx {r['context']:5d} batch {r['batch']:3d}: {r['us']:8.1f} us, "
              f"{share} of the roofline on {r['kv_bytes'] / 1e6:.0f} MB, max |error| vs bf16 "
              f"{r['max_abs_error_vs_bf16']:.3g}")
    for fmt, err in result.get("errors", {}).items():
        print(f"{fmt}: {err}")
    for fmt, by_ctx in result.get("concurrency", {}).items():
        print(f"{fmt}: sequences in {result['kv_memory_bytes'] >> 20} MiB of KV: " +
              ", ".join(f"{n} at {c}" for c, n in by_ctx.items()))
    for r in result.get("perplexity", []):
        vs = f" ({r['vs_bf16']:+.2%} vs bf16)" if "vs_bf16" in r else ""
        print(f"perplexity {r.get('format', '')}: " + (f"{r['perplexity']:.4f}{vs}" if "perplexity" in r else
                                                        str(r.get("error") or r.get("skipped"))))
    fp8 = {(r["context"], r["batch"]): r["decode_tok_s"] for r in result.get("runs", []) if r["format"] == "fp8"}
    bf16 = {(r["context"], r["batch"]): r["decode_tok_s"] for r in result.get("runs", []) if r["format"] == "bf16"}
    for key in sorted(fp8.keys() & bf16.keys()):
        print(f"fp8 / bf16 decode tok/s at context {key[0]}, batch {key[1]}: {fp8[key] / bf16[key]:.2f}x")
    for line in target_lines(result):
        print(line)


def main() -> None:
    from bench.gpu_check import copy_bandwidth, prepare_smollm2

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small shapes (a dry run of the logic)")
    ap.add_argument("--smollm2-gguf", default=None)
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu_kv.json"))
    args = ap.parse_args()
    device = torch.device(args.device)
    bw = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (128 << 20))
    result = kv_formats(device, bw, args.quick, prepare_smollm2(args.smollm2_gguf))
    result["copy_bandwidth_GBps"] = bw / 1e9
    result["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
