"""What each precision of the CPU prefill's linears costs in perplexity and buys in speed, on SmolLM2.

    .venv/bin/python -m bench.prefill_precision
    INFINILM_CPU_ISA=avx2 .venv/bin/python -m bench.prefill_precision    # the libraries capped at AVX2 too

Arms, one engine each (SmolLM2's GGUF, fp32, its default compact panels), in one process:
- float32: the default, exact;
- bfloat16: `execution.cpu_prefill_dtype: bfloat16` (a start-up error on CPUs without AVX512-BF16 or AMX;
  here it is forced on, and its speed marked "emulated", so its perplexity is measured on every host);
- int8 W8A8, and the same with down_proj kept fp32: NOT engine options, measured to show why. The bf16
  path's products are swapped for int8 ones (torch._int_mm: per-output-channel int8 weights, int8 rows
  scaled per token), the arrangement that runs the products at twice the fp32 rate on AVX2 hosts.
Per arm: perplexity on the first --tokens tokens of GPL-3 (windows of --context, stride half of it), its
change over float32's, and the median rate of --rounds prefills of a 400-token prompt alone. Writes
bench/results/prefill_precision[-ISA].json and its section of docs/perf/cpu-engine.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
from pathlib import Path

import torch

from bench.llamacpp_peer import prefill_seconds
from bench.report import PERF, publish_table, run_info, write_json
from bench.throughput import progress_bar
from engine import LLM, platform_tuning
from engine.kernels.cpu_build import bf16_matmul_isa, host_isa
from engine.models import linear as lin
from engine.perplexity import perplexity

TEXT = Path("/usr/share/common-licenses/GPL-3")
ARMS = ("float32", "bfloat16", "int8 W8A8", "int8 W8A8, down_proj fp32")


def _int8_copies(model: torch.nn.Module, keep_fp32: tuple[str, ...]) -> int:
    """In place of the bf16 copies: (int8 weight [in, out], fp32 scale per output channel) per linear."""
    for name, module in model.named_modules():
        if isinstance(module, lin.Linear) and module.weight.dtype == torch.float32 and not name.endswith(keep_fp32):
            w = lin.plain_weight(module.weight, module.packed)
            scale = w.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
            module.bf16 = (torch.round(w / scale).clamp(-127, 127).to(torch.int8).t().contiguous(), scale.view(-1))
    return 0


def _int8_product(x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
    codes, w_scale = weight
    x_scale = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    out = torch._int_mm(torch.round(x / x_scale).clamp(-127, 127).to(torch.int8), codes).float() * x_scale * w_scale
    return out if bias is None else out + bias


@contextlib.contextmanager
def arm_hooks(arm: str):
    """The engine as the arm runs it: bf16 forced on (on any CPU), or its products swapped for int8 ones."""
    saved = (platform_tuning.bf16_matmul_isa, platform_tuning.add_bf16_copies, lin._bf16_product)
    if arm != "float32":
        platform_tuning.bf16_matmul_isa = lambda: "forced"
    if arm.startswith("int8"):
        keep = ("down_proj",) if "down_proj" in arm else ()
        platform_tuning.add_bf16_copies = lambda model: _int8_copies(model, keep)
        lin._bf16_product = _int8_product
    try:
        yield
    finally:
        platform_tuning.bf16_matmul_isa, platform_tuning.add_bf16_copies, lin._bf16_product = saved


def prefill_rate(llm: LLM, prompt: list[int], rounds: int) -> float:
    # The first round warms up.
    seconds = [prefill_seconds(llm, prompt, f"prefill{r}") for r in range(rounds + 1)]
    return statistics.median(len(prompt) / s for s in seconds[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="GPL-3 tokens scored (default 2048)")
    ap.add_argument("--context", type=int, default=1024, help="tokens per perplexity window (stride: half)")
    ap.add_argument("--rounds", type=int, default=3, help="timed 400-token prefills per arm (median)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = {**run_info("bench.prefill_precision", args.threads), "bf16_isa": bf16_matmul_isa(), "arms": {}}
    with progress_bar("prefill precision", len(ARMS)) as advance:
        for arm in ARMS:
            with arm_hooks(arm):
                llm = LLM(model="smollm2", dtype="float32", num_threads=args.threads,
                          max_num_batched_tokens=max(1024, args.context),
                          cpu_prefill_dtype="float32" if arm == "float32" else "bfloat16")
            ids = llm.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
            with arm_hooks(arm):
                ppl = perplexity(llm, ids[:args.tokens], args.context, args.context // 2).perplexity
                rate = prefill_rate(llm, ids[2000:2400], args.rounds)
            data["arms"][arm] = {"perplexity": ppl, "prefill_tok_s": rate}
            del llm
            advance()
    suffix = "" if data["isa"] == host_isa() else f"-{data['isa']}"
    write_json(f"prefill_precision{suffix}.json", data)
    base = data["arms"]["float32"]
    rows = []
    for arm, v in data["arms"].items():
        note = " (emulated: no bf16 instructions)" if arm == "bfloat16" and data["bf16_isa"] is None else ""
        rows.append((arm + ("" if arm in ("float32", "bfloat16") else " (not an option)"), f"{v['perplexity']:.4f}",
                     f"{(v['perplexity'] / base['perplexity'] - 1) * 100:+.2f}%", f"{v['prefill_tok_s']:.0f}{note}",
                     f"{v['prefill_tok_s'] / base['prefill_tok_s']:.2f}x"))
    publish_table(
        f"prefill_precision{suffix}", f"Prefill precision: perplexity and speed (SmolLM2-135M, CPU, {data['isa']} path)",
        data, f"SmolLM2's GGUF at fp32 with its default compact panels, one engine per arm; perplexity on the first "
        f"{args.tokens} tokens of GPL-3 in windows of {args.context} (stride {args.context // 2}), whose scored "
        f"positions all come from prompt steps; prefill: the median of {args.rounds} 400-token prompts alone. int8 "
        "rows are measured to show why they are not offered: per-output-channel int8 weights and rows scaled per "
        "token, through torch._int_mm, in place of the bf16 products.",
        "Perplexity and prefill rate by the precision of prompt steps' linears",
        ["prompt steps' linears", "perplexity", "change", "prefill tok/s (400 tokens)", "over float32"], rows,
        docs=PERF / "cpu-engine.md")


if __name__ == "__main__":
    main()
