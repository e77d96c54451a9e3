"""Decode steps at large batches with an fp32 KV cache against an int8 one (cache_bits: 8), SmolLM2-135M.

    .venv/bin/python -m bench.kv_decode
    .venv/bin/python -m bench.kv_decode --batches 48 --context 768 --rounds 5

At batch 48 with a few hundred tokens of context, a decode step reads more KV cache than weights
(46,080 bytes per token in fp32 against 11,880 in int8). Both engines run in one process with
`cpu_prepack_weights`, so their decode-only steps go through the one-call decoder
(decode_layers); they alternate round after round, and each round's decode-only steps at the
full batch are timed by the engine itself (prefill excluded: the prompts are distinct passages of
/usr/share/common-licenses/GPL-3, prefilled in the first round and served by the prefix cache
after it). Medians of the rounds are compared. The last column is how many of the int8 engine's
greedy sequences equal the fp32 engine's, token for token.

Then the whole workload of bench.throughput (64 requests, prompts of 32-512 tokens, 32-256 output
tokens) on each cache, alternating `--workload-rounds` times, with the wall time split into steps
that prefill and decode-only steps at and below batch 32. Writes bench/results/kv_decode.json and
its section of docs/perf/memory.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench import roofline
from bench.report import PERF, markdown_table, print_table, publish_table, run_info, write_json
from bench.throughput import Settings, build_workload, greedy, progress_bar, run_engine
from engine import LLM
from engine.kv_cache import bytes_per_block
from engine.model_registry import resolve_model
from engine.models.config import ModelConfig

TEXT = Path("/usr/share/common-licenses/GPL-3")
ARMS = {"fp32 KV": 16, "int8 KV": 8}  # name -> cache_bits


def passages(llm: LLM, count: int, tokens: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of exactly `tokens` tokens from distinct offsets of the text."""
    ids = llm.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    if len(ids) < tokens + count:
        raise SystemExit(f"{TEXT} has {len(ids)} tokens, too few for {count} prompts of {tokens}")
    starts = random.Random(seed).sample(range(len(ids) - tokens), count)
    return [ids[s:s + tokens] for s in starts]


def decode_steps(llm: LLM, prompts: list[list[int]], steps: int, tag: str) -> tuple[list[float], list[list[int]]]:
    """Step times of the decode-only steps at the full batch, and each request's tokens."""
    engine = llm.engine
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, greedy(steps))
    times, done = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            if out.finished:
                done[out.request_id] = list(out.token_ids)
        st = engine.last_stats
        if not st.step_prefill_tokens and st.step_decode_seqs == len(prompts):
            times.append(st.step_time_s)
    return times, [done[rid] for rid in ids]


def alternate_rounds(llms: dict[str, LLM], prompts: list[list[int]], steps: int, rounds: int,
                     advance) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """The engines take turns, `rounds` times, decoding `prompts` together: per engine, each round's median
    decode-only step time at the full batch, and its last round's tokens."""
    times: dict[str, list[float]] = {name: [] for name in llms}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(rounds):
        for name, llm in llms.items():
            t, tokens[name] = decode_steps(llm, prompts, steps, f"b{len(prompts)}-r{r}")
            if not t:
                raise RuntimeError(f"{name}: no decode-only step ran at batch {len(prompts)}")
            times[name].append(statistics.median(t))
            advance()
    return times, tokens


def measure_batches(llms: dict[str, LLM], prompts: list[list[int]], args: argparse.Namespace, label: str,
                    equal_key: str) -> dict[int, dict]:
    """Per batch in args.batches: each engine's median step time over `alternate_rounds`, the rounds' times,
    and (as `equal_key`) how many sequences the first two engines decoded to the same tokens."""
    first, second = list(llms)[:2]
    out: dict[int, dict] = {}
    with progress_bar(label, len(args.batches) * args.rounds * len(llms)) as advance, torch.inference_mode():
        for name, llm in llms.items():  # prefill every prompt once; later rounds hit the prefix cache
            decode_steps(llm, prompts, 2, f"warm-{name}")
        for batch in args.batches:
            times, tokens = alternate_rounds(llms, prompts[:batch], args.steps, args.rounds, advance)
            out[batch] = {"median_step_s": {n: statistics.median(v) for n, v in times.items()},
                          "round_step_s": times,
                          equal_key: sum(a == b for a, b in zip(tokens[first], tokens[second], strict=True))}
    return out


def parse_args(doc: str, batches: list[int], arms: str, extra=None) -> argparse.Namespace:
    """The options of an alternating decode-step benchmark (this one, bench.compact_weights), checked;
    `extra(parser)` adds a benchmark's own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if extra is not None:
        extra(ap)
    ap.add_argument("--batches", type=int, nargs="+", default=batches, help="sequences decoding together")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=24, help="output tokens per sequence and round")
    ap.add_argument("--rounds", type=int, default=3, help=f"alternations of the two {arms} (medians compared)")
    ap.add_argument("--workload-rounds", type=int, default=2,
                    help=f"alternations of the two {arms} on bench.throughput's workload (0: skip it)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    if (min(args.batches) < 1 or max(args.batches) > 256 or args.context < 1 or args.steps < 2 or args.rounds < 1
            or args.workload_rounds < 0):
        raise SystemExit("--batches must be 1-256, --context >= 1, --steps >= 2, --rounds >= 1 and "
                         "--workload-rounds >= 0")
    torch.set_num_threads(args.threads)
    return args


def main() -> None:
    args = parse_args(__doc__, [16, 48], "caches")
    biggest = max(args.batches)
    block_size = 16
    blocks = biggest * -(-(args.context + args.steps) // block_size) * 2 + 64  # every round's rows, and slack
    # fp32 panels (cpu_compact_weights off), as in this benchmark's earlier runs: the caches are what is compared.
    llms = {name: LLM(model="smollm2", dtype="float32", cpu_prepack_weights=True, cpu_compact_weights=False,
                      cache_bits=bits,
                      block_size=block_size, num_kv_blocks=blocks, max_num_seqs=biggest,
                      max_model_len=args.context + args.steps + 16, max_num_batched_tokens=4096)
            for name, bits in ARMS.items()}
    mc = llms["fp32 KV"].engine.model_config
    row_bytes = {name: bytes_per_block(mc, 1, torch.float32, bits) for name, bits in ARMS.items()}
    prompts = passages(llms["fp32 KV"], biggest, args.context)
    data = {**run_info("bench.kv_decode", args.threads), "context": args.context, "steps": args.steps,
            "rounds": args.rounds, "kv_bytes_per_token": row_bytes, "batches": {}}
    data["batches"] = measure_batches(llms, prompts, args, "kv decode", "int8_sequences_equal_fp32")
    del llms
    gc.collect()
    if args.workload_rounds:
        data["workload"] = whole_workload(args.workload_rounds)
    write_json("kv_decode.json", data)
    headers = ["batch", "KV read per step, fp32 / int8", "fp32 KV ms/step", "int8 KV ms/step", "int8 tok/s",
               "int8 ÷ fp32 speed", "int8 greedy = fp32"]
    rows = []
    for batch, r in data["batches"].items():
        m = r["median_step_s"]
        kv_tokens = batch * (args.context + args.steps / 2)
        read = " / ".join(f"{kv_tokens * row_bytes[n] / 2**20:.0f} MiB" for n in ARMS)
        rows.append((batch, read, f"{m['fp32 KV'] * 1e3:.1f}", f"{m['int8 KV'] * 1e3:.1f}",
                     f"{batch / m['int8 KV']:.0f}", f"{m['fp32 KV'] / m['int8 KV']:.2f}×",
                     f"{r['int8_sequences_equal_fp32']}/{batch}"))
    publish_table(
        "kv_decode", "Decode steps with an int8 KV cache (SmolLM2-135M, fp32 weights, CPU)", data,
        f"prompts of {args.context} tokens, {args.steps} greedy output tokens, both caches in one process with "
        f"cpu_prepack_weights (decode-only steps through decode_layers), alternating {args.rounds} rounds; the "
        "median of each round's decode-only steps at the full batch, then the median over rounds. KV bytes per "
        f"token: {row_bytes['fp32 KV']} fp32, {row_bytes['int8 KV']} int8 (values plus one fp16 scale per row "
        "and KV head). Perplexity of the int8 cache is in the quantization table above.",
        f"ms per decode step, context {args.context}", headers, rows, extra=workload_table(data.get("workload")), docs=PERF / "memory.md")


def whole_workload(rounds: int, arms: dict[str, dict] | None = None, equal_key: str = "int8_requests_equal_fp32") -> dict:
    """bench.throughput's workload on each arm (name -> LLM options, over cpu_prepack_weights true; default: the two
    caches), alternating; per round the wall time and its split. `equal_key`: how many requests' greedy tokens the
    first two arms share."""
    arms = arms if arms is not None else {name: {"cache_bits": bits, "cpu_compact_weights": False}
                                          for name, bits in ARMS.items()}
    s = Settings()
    path = resolve_model("smollm2")
    mc = ModelConfig.from_folder(path)
    kv_tokens = s.num_requests * (s.prompt_lens[1] + s.output_lens[1] + 16)
    out: dict = {name: {"wall_s": [], "prefill_steps_s": [], "decode_ge32_s": [], "decode_lt32_s": []}
                 for name in arms}
    tokens: dict[str, list[list[int]]] = {}
    with progress_bar("whole workload", rounds * len(arms)) as advance:
        for _ in range(rounds):
            for name, options in arms.items():
                llm = LLM(model=str(path), dtype="float32", max_num_seqs=64, max_num_batched_tokens=2048,
                          **{"cpu_prepack_weights": True, **options},
                          kv_cache_memory_bytes=kv_tokens * roofline.kv_bytes_per_token(mc))
                ids = llm.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
                llm.generate([ids[:16], ids[16:40]], [greedy(8), greedy(4)])
                run = run_engine(llm, build_workload(ids, s, 0), tag=f"w-{name}")
                r = out[name]
                r["wall_s"].append(run.wall_s)
                r["prefill_steps_s"].append(sum(t for t, p, _, _ in run.steps if p))
                r["decode_ge32_s"].append(sum(t for t, p, d, _ in run.steps if not p and d >= s.decode_min_batch))
                r["decode_lt32_s"].append(sum(t for t, p, d, _ in run.steps if not p and d < s.decode_min_batch))
                r["output_tokens"] = sum(map(len, run.outputs))
                tokens[name] = run.outputs
                del llm
                gc.collect()
                advance()
    first, second = list(arms)[:2]
    out[equal_key] = sum(a == b for a, b in zip(tokens[first], tokens[second], strict=True))
    out["num_requests"] = s.num_requests
    return out


def workload_table(w: dict | None, arms: tuple[str, ...] = tuple(ARMS), label: str = "cache",
                   equal: str = "int8 greedy tokens equal fp32's", equal_key: str = "int8_requests_equal_fp32") -> str:
    """whole_workload's medians as a table (printed, and returned as markdown); the first arm is the base."""
    if not w:
        return ""
    base = arms[0]
    med = {name: {k: statistics.median(v) for k, v in w[name].items() if isinstance(v, list)} for name in arms}
    rows = [(name, f"{m['wall_s']:.1f}", f"{w[name]['output_tokens'] / m['wall_s']:.1f}",
             f"{med[base]['wall_s'] / m['wall_s']:.2f}×", f"{m['prefill_steps_s']:.1f}",
             f"{m['decode_ge32_s']:.1f}", f"{m['decode_lt32_s']:.1f}") for name, m in med.items()]
    headers = [label, "wall s", "output tok/s", f"speed ÷ {base}", "steps with prefill s", "decode-only ≥ 32 s",
               "decode-only < 32 s"]
    title = (f"bench.throughput's workload, medians of {len(w[base]['wall_s'])} alternating runs "
             f"({equal} for {w[equal_key]}/{w['num_requests']} requests)")
    print_table(title, headers, rows)
    return markdown_table(title, headers, rows)


if __name__ == "__main__":
    main()
