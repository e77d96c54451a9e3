"""Where a single stream's decode step goes, against the memory floor measured at the same moment.

    .venv/bin/python -m bench.single_stream
    .venv/bin/python -m bench.single_stream --rounds 8 --tokens 256

One greedy request of 128 prompt tokens (bench.throughput's text) on bench.throughput's headline engine
(fp32 panels: `cpu_prepack_weights: true, cpu_compact_weights: false`), in two engines in one process that
differ only in `huge_pages`: false (torch's 4 KiB pages) and "auto", the default (the weights a decode step
streams in 2 MiB pages, found within a time budget), alternating round after round. Each round times its decode steps three ways: the one C++ call
that runs every layer (decode_layers, the embedding lookup and the final norm included), the LM head, and the
rest of the step (scheduling, inputs, sampling, detokenization: Python). Right before and right
after each round a read probe (roofline.ReadProbe, the better of 4 KiB and huge pages) gives that round its
own floor: the weight bytes a step reads over the read rate. This VM's read rate moves by up to 2x within
seconds, so a round's share of its floor is the figure to trust, not a comparison across rounds.

Then, in the same run, llama.cpp as a peer (bench/llamacpp_peer.py): the engine with the GGUF model's default
weights (compact panels) against llama-cpp-python on the same GGUF file and thread count, single-stream decode
(--tokens after the same 128-token prompt) and prefill of a 400-token prompt, rounds alternating within each. The
peer runs in its own environment, .venv-llamacpp (bench/llamacpp_env.sh creates it); without it the peer row says
so and how to create it.

Writes bench/results/single_stream.json and its sections of docs/perf/cpu-engine.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench import llamacpp_peer, roofline
from bench.report import PERF, publish_table, run_info, write_json
from bench.throughput import TEXT, decode_weight_bytes, progress_bar
from engine import LLM, SamplingParams
from engine.kernels.cpu_build import bf16_matmul_isa, cpu_kernels
from engine.model_registry import gguf_file

ARMS = {"4 KiB pages (huge_pages false)": False, "weights in huge pages (huge_pages auto, the default)": "auto"}


class PhaseClock:
    """Seconds spent in the model's one-call decoder and in its LM head, added up across calls."""

    def __init__(self, model) -> None:
        self.layers = self.head = 0.0
        model.fused_decoder.run_layers = self._timed(model.fused_decoder.run_layers, "layers")
        model.compute_logits = self._timed(model.compute_logits, "head")

    def _timed(self, fn, phase: str):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                setattr(self, phase, getattr(self, phase) + time.perf_counter() - t)

        return timed

    def reset(self) -> None:
        self.layers = self.head = 0.0


def one_round(llm: LLM, clock: PhaseClock, prompt: list[int], tokens: int) -> dict:
    """One request of `tokens` greedy tokens; the decode steps' seconds by phase (the prefill step excluded)."""
    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    engine.add_request("single", prompt, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0))
    engine.step()  # the prefill
    clock.reset()
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    wall = time.perf_counter() - t0
    return {"steps": steps, "step_ms": wall / steps * 1e3, "layers_ms": clock.layers / steps * 1e3,
            "head_ms": clock.head / steps * 1e3, "rest_ms": (wall - clock.layers - clock.head) / steps * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6, help="rounds per arm, alternating (default 6)")
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per round (default 128)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    args = ap.parse_args()
    if args.rounds < 1 or args.tokens < 2:
        ap.error("--rounds must be at least 1 and --tokens at least 2")
    if cpu_kernels() is None:
        raise SystemExit("the CPU kernels could not be built here: there is no one-call decoder to time")
    torch.set_num_threads(args.threads)
    data = {**run_info("bench.single_stream", args.threads), "rounds": args.rounds, "tokens": args.tokens, "arms": {}}
    from engine.kernels.cpu_build import host_isa

    # A capped ISA (INFINILM_CPU_ISA) is not the host's own figure: its JSON and docs sections are its own.
    data["suffix"] = "" if data["isa"] == host_isa() else f"-{data['isa']}"
    llms, clocks = {}, {}
    for arm, huge in ARMS.items():
        t0 = time.perf_counter()
        llms[arm] = LLM(model="smollm2", dtype="float32", num_threads=args.threads, max_num_seqs=4,
                        kv_cache_memory_bytes=64 << 20, cpu_prepack_weights=True, cpu_compact_weights=False,
                        huge_pages=huge)
        data["arms"][arm] = {"start_s": time.perf_counter() - t0, "rounds": []}
        if llms[arm].engine.model.fused_decoder is None:
            raise SystemExit("this model does not take the one-call decoder here; nothing to split")
        clocks[arm] = PhaseClock(llms[arm].engine.model)
    first = next(iter(llms.values()))
    weight_bytes = decode_weight_bytes(first.engine.model)
    data["weight_bytes"] = weight_bytes
    prompt = first.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)[1000:1128]
    probe = roofline.ReadProbe()
    tokens: dict[str, list[int]] = {}
    for arm, llm in llms.items():  # warm-up, and the tokens every round must repeat
        tokens[arm] = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))[0].token_ids
    if len(set(map(tuple, tokens.values()))) != 1:
        raise SystemExit(f"the arms disagree on greedy tokens: {tokens}")
    with progress_bar("single-stream rounds", args.rounds * len(llms)) as advance:
        for _ in range(args.rounds):
            for arm, llm in llms.items():
                before = probe()
                r = one_round(llm, clocks[arm], prompt, args.tokens)
                r["read_gbps"] = max(before, probe())
                floor_ms = weight_bytes / (r["read_gbps"] * 1e9) * 1e3
                r["floor_ms"] = floor_ms
                r["share"] = floor_ms / r["step_ms"]
                r["weights_gbps"] = weight_bytes / ((r["layers_ms"] + r["head_ms"]) / 1e3) / 1e9
                data["arms"][arm]["rounds"].append(r)
                advance()
    for arm in llms:
        rounds = data["arms"][arm]["rounds"]
        data["arms"][arm]["median"] = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    write_json(f"single_stream{data['suffix']}.json", data)

    headers = ["pages", "engine start s", "read GB/s", "floor ms", "step ms", "decode_layers ms", "LM head ms",
               "rest of step ms", "weights read at GB/s", "share of floor (median of rounds)", "tok/s"]
    rows = []
    for arm, v in data["arms"].items():
        m = v["median"]
        rows.append((arm, f"{v['start_s']:.1f}", f"{m['read_gbps']:.1f}", f"{m['floor_ms']:.2f}", f"{m['step_ms']:.2f}",
                     f"{m['layers_ms']:.2f}", f"{m['head_ms']:.2f}", f"{m['rest_ms']:.2f}", f"{m['weights_gbps']:.1f}",
                     f"{m['share'] * 100:.1f}%", f"{1e3 / m['step_ms']:.1f}"))
    by_round = "\n".join(
        f"- {arm}: " + "; ".join(f"{r['read_gbps']:.0f} GB/s, {r['step_ms']:.1f} ms, {r['share'] * 100:.0f}%"
                                 for r in v["rounds"]) for arm, v in data["arms"].items())
    publish_table(
        f"single_stream{data['suffix']}", f"Where a single stream's decode step goes (SmolLM2-135M, fp32 panels, CPU, {data['isa']} kernels)", data,
        f"one greedy request, 128 prompt tokens, {args.tokens} output tokens; two engines in one process, "
        f"`huge_pages` false and auto (the default: the decode-streamed weights in huge pages), alternating "
        f"{args.rounds} rounds. Per round, the decode steps' mean split "
        "into the one-call decoder (the embedding lookup, every layer and the final norm), the LM head, and the "
        "rest of the step (Python: scheduling, inputs, sampling, detokenization); each round's floor is "
        f"{weight_bytes / 2**20:.0f} MiB of weights over the better read rate of the probes right before and "
        "right after it. Medians over rounds, each column on its own.",
        "Median over rounds", headers, rows,
        "Each round (read rate, step, share of its own floor):\n\n" + by_round, docs=PERF / "cpu-engine.md")
    llms.clear()  # the peer section builds its own engine
    peer_section(args, data, first.tokenizer.encode(TEXT.read_text(), add_special_tokens=False))


def peer_section(args, data: dict, text_ids: list[int]) -> None:
    """The engine (default weights of the GGUF model; also with bf16 prefill where the CPU multiplies bf16) and
    llama.cpp on the same file and threads: one table."""
    prefill_prompt, decode_prompt = text_ids[2000:2400], text_ids[1000:1128]
    arms = {"engine (default weights: compact panels)": {}}
    if bf16_matmul_isa() is not None:
        arms[f"engine, cpu_prefill_dtype bfloat16 ({bf16_matmul_isa()})"] = {"cpu_prefill_dtype": "bfloat16"}
    engines = {}
    for arm, options in arms.items():
        llm = LLM(model="smollm2", dtype="float32", num_threads=args.threads, max_num_seqs=4,
                  kv_cache_memory_bytes=64 << 20, **options)
        engines[arm] = llamacpp_peer.engine_rates(llm, prefill_prompt, decode_prompt, args.tokens, args.rounds)
        del llm
    engine = next(iter(engines.values()))
    peer: dict = {"gguf": str(gguf_file("smollm2")), "engine": engine, "engines": engines}
    try:
        peer["llamacpp"] = llamacpp_peer.llamacpp_rates(gguf_file("smollm2"), args.threads, prefill_prompt,
                                                        decode_prompt, args.tokens, args.rounds)
    except llamacpp_peer.PeerMissing as missing:
        peer["llamacpp"] = {"missing": str(missing)}
    data["peer"] = peer
    write_json(f"single_stream{data['suffix']}.json", data)
    lc = peer["llamacpp"]
    rows = []
    for arm, rates in engines.items():
        over = ("-", "-") if "missing" in lc else (f"{rates['decode_tok_s'] / lc['decode_tok_s']:.2f}x",
                                                  f"{rates['prefill_tok_s'] / lc['prefill_tok_s']:.2f}x")
        rows.append((arm, f"{rates['decode_tok_s']:.1f}", f"{rates['prefill_tok_s']:.0f}", *over))
    if "bfloat16" not in " ".join(engines):
        rows.append(("engine, cpu_prefill_dtype bfloat16: NOT RUN", "-", "-", "-",
                     "this CPU (or the INFINILM_CPU_ISA cap) has no AVX512-BF16 or AMX"))
    if "missing" in lc:
        print(lc["missing"])
        rows.append(("llama.cpp: NOT RUN", "-", "-", "-", f"missing .venv-llamacpp: run {llamacpp_peer.ENV_SCRIPT}"))
    else:
        peer["same_greedy_tokens"] = {arm: lc["tokens"][:len(r["tokens"])] == r["tokens"][:len(lc["tokens"])]
                                      for arm, r in engines.items()}
        simd = llamacpp_peer.simd_path(lc.get("system_info", ""))
        rows.append((f"llama.cpp {lc['version']} (llama-cpp-python, built from source, {simd} build)",
                     f"{lc['decode_tok_s']:.1f}", f"{lc['prefill_tok_s']:.0f}", "1.00x", "1.00x"))
    write_json(f"single_stream{data['suffix']}.json", data)  # again, with the token comparison
    publish_table(
        f"single_stream_llamacpp{data['suffix']}", f"Single stream against llama.cpp (SmolLM2-135M Q4_1 GGUF, CPU, {data['isa']} kernels)", data,
        f"the same GGUF file ({Path(peer['gguf']).name}) and {args.threads} threads; decode: {args.tokens} greedy "
        "tokens after a 128-token prompt, from the second token on; prefill: a 400-token prompt alone. The engine "
        "with its defaults for the file (compact panels), and with `cpu_prefill_dtype: bfloat16` where the CPU "
        f"multiplies bf16; llama.cpp in its own environment; {args.rounds} rounds each, medians. The last two "
        "columns are each row's rate over llama.cpp's.",
        "Medians over rounds", ["runtime", "decode tok/s", "prefill tok/s", "over llama.cpp, decode",
                                "over llama.cpp, prefill"], rows, docs=PERF / "cpu-engine.md")


if __name__ == "__main__":
    main()
