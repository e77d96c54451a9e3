"""The fused fp32 CPU kernels (RMSNorm, residual add + RMSNorm, RoPE, SwiGLU's activation) against torch ops.

    .venv/bin/python -m bench.kernels.fused_kernels
    .venv/bin/python -m bench.kernels.fused_kernels --rounds 6 --batch 32

One SmolLM2-135M fp32 engine without packed weight copies (cpu_prepack_weights false) runs single-stream decode, decode at a fixed batch
and prefill-only steps, alternately with the fused kernels (engine/models/csrc/fused_cpu.cpp) and
with the torch ops (the model's fallback when the extension cannot be built), in the same process,
round after round, so that both arms see the same machine; the medians over the rounds are
compared. Writes bench/results/kernels/fused_kernels.json and its section of docs/perf/kernels.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from unittest import mock

import torch

from bench.report import PERF, publish_table, run_info, write_json
from bench.throughput import progress_bar
from engine import LLM, SamplingParams


@contextlib.contextmanager
def fused(enabled: bool) -> Iterator[None]:
    """The model's fp32 CPU norms, RoPE and SwiGLU activation on the fused kernels (as shipped) or on torch ops."""
    if enabled:
        yield
        return
    with mock.patch("engine.models.llama.fused_cpu_ok", lambda _x: False), \
            mock.patch("engine.models.rope.fused_cpu_ok", lambda _x: False):
        yield


def decode_tok_s(llm: LLM, batch: int, prompt_len: int, new_tokens: int, tag: str) -> float:
    """Output tokens/s of decode steps only, for `batch` greedy requests prefilled first."""
    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    for i in range(batch):
        prompt = [(7 * i + j) % 40000 + 100 for j in range(prompt_len)]
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    while True:  # prefill steps, until every request has its first token
        outputs = engine.step()
        if len(outputs) == batch and all(o.token_ids for o in outputs):
            break
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps * batch / (time.perf_counter() - t0)


def prefill_tok_s(llm: LLM, num: int, prompt_len: int, tag: str) -> float:
    """Prompt tokens/s of `num` requests of `prompt_len` tokens, prefilled and given one token each."""
    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    for i in range(num):
        prompt = [(11 * i + 3 * j) % 40000 + 100 for j in range(prompt_len)]
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return num * prompt_len / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6, help="alternations of the two arms (medians are compared)")
    ap.add_argument("--batch", type=int, default=32, help="sequences in the batched decode measurement")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--tokens", type=int, default=48, help="tokens generated per request")
    ap.add_argument("--prefill", type=int, nargs=2, default=[8, 512], metavar=("REQUESTS", "TOKENS"),
                    help="the prefill measurement: REQUESTS prompts of TOKENS tokens each")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # No packed weight copies (the defaults until 2026-12-05): the fused kernels are those of the layer-by-layer path.
    llm = LLM(model="smollm2", dtype="float32", cpu_prepack_weights=False)
    num, plen = args.prefill
    prefill_case = f"prefill, {num} prompts of {plen} tokens (prompt tok/s)"
    cases = {"single stream": 1, f"decode, batch {args.batch}": args.batch, prefill_case: 0}
    rates: dict[str, dict[str, list[float]]] = {c: {"torch ops": [], "fused kernels": []} for c in cases}
    decode_tok_s(llm, 1, args.prompt, 8, "warm")
    with progress_bar("fused kernels A/B", args.rounds) as advance:
        for r in range(args.rounds):
            for arm, enabled in (("torch ops", False), ("fused kernels", True)):
                with fused(enabled):
                    for case, batch in cases.items():
                        tag = f"{r}-{arm}-{case}"
                        rates[case][arm].append(prefill_tok_s(llm, num, plen, tag) if case == prefill_case else
                                                decode_tok_s(llm, batch, args.prompt, args.tokens, tag))
            advance()
    medians = {c: {arm: statistics.median(v) for arm, v in arms.items()} for c, arms in rates.items()}
    data = {**run_info("bench.kernels.fused_kernels", args.threads), "settings": vars(args), "rates": rates,
            "medians": medians}
    write_json("kernels/fused_kernels.json", data)
    headers = ["phase", "torch ops tok/s", "fused kernels tok/s", "fused ÷ torch"]
    rows = [(c, f"{m['torch ops']:.1f}", f"{m['fused kernels']:.1f}", f"{m['fused kernels'] / m['torch ops']:.2f}×")
            for c, m in medians.items()]
    title = "Decode and prefill with the fused fp32 CPU kernels and with torch ops (medians of alternating rounds)"
    publish_table(
        "fused_kernels", "Fused CPU kernels: RMSNorm, residual add + RMSNorm, RoPE, SwiGLU activation", data,
        f"SmolLM2-135M fp32 without packed weight copies (cpu_prepack_weights false, the engine's defaults until "
        "2026-12-05); decode: {args.prompt}-token prompts, {args.tokens} greedy "
        f"tokens each, decode steps only; prefill: {num} prompts of {plen} tokens, one token each, every step "
        f"timed; the two arms alternate {args.rounds} times in one process and the medians are compared.",
        title, headers, rows, docs=PERF / "kernels.md")

if __name__ == "__main__":
    main()
