"""llama.cpp as a peer of the engine: single-stream decode and prefill on the same GGUF file and thread count.

bench.single_stream runs both in one run: the engine in its own process, llama.cpp (llama-cpp-python built from
source) in a subprocess of its own environment, .venv-llamacpp, which bench/llamacpp_env.sh creates. Where that
environment is missing the peer is reported as not run, with the command that creates it, never left out quietly.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from engine import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[1]
# LLAMACPP_VENV picks another build, e.g. one made with CMAKE_ARGS for AVX2 only (bench/llamacpp_env.sh).
VENV = Path(os.environ.get("LLAMACPP_VENV", REPO / ".venv-llamacpp")).resolve()
ENV_SCRIPT = "bench/llamacpp_env.sh"
WORKER = Path(__file__).with_name("llamacpp_worker.py")


class PeerMissing(RuntimeError):
    """The llama.cpp environment is not there; the message says how to create it."""


def peer_python() -> Path:
    python = VENV / "bin" / "python"
    if not python.is_file():
        raise PeerMissing(f"llama.cpp peer not run: {VENV} is missing. Create it once with `{ENV_SCRIPT}` "
                          "(builds llama-cpp-python from source), then rerun this bench.")
    return python


def llamacpp_rates(gguf: Path, threads: int, prefill_prompt: list[int], decode_prompt: list[int],
                   decode_tokens: int, rounds: int) -> dict:
    """llama.cpp's rates, per round and median: prefill and decode tokens per second. Raises PeerMissing."""
    job = {"gguf": str(gguf), "threads": threads, "prefill_prompt": prefill_prompt, "decode_prompt": decode_prompt,
           "decode_tokens": decode_tokens, "rounds": rounds}
    run = subprocess.run([str(peer_python()), str(WORKER)], input=json.dumps(job), capture_output=True, text=True,
                         timeout=1800)
    if run.returncode != 0:
        raise RuntimeError(f"the llama.cpp worker failed ({run.returncode}): {run.stderr[-3000:]}")
    out = json.loads(run.stdout.strip().splitlines()[-1])
    return {**out, **medians(out["rounds"])}


def prefill_seconds(llm: LLM, prompt: list[int], request_id: str) -> float:
    """Seconds the engine takes to prefill `prompt` alone, from an empty prefix cache, up to its first token."""
    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def engine_rates(llm: LLM, prefill_prompt: list[int], decode_prompt: list[int], decode_tokens: int,
                 rounds: int) -> dict:
    """The engine's rates by the same protocol: a prefill of `prefill_prompt` alone (one request that ends at its
    first token), then greedy decode steps after `decode_prompt`; the prefix cache reset before each."""
    engine, out = llm.engine, []
    tokens: list[int] = []
    for r in range(rounds):
        prefill_s = prefill_seconds(llm, prefill_prompt, f"prefill{r}")
        engine.block_manager.reset_prefix_cache()
        params = SamplingParams(max_tokens=decode_tokens + 1, temperature=0, ignore_eos=True)
        engine.add_request(f"decode{r}", decode_prompt, params)
        engine.step()  # the prefill and the first token
        t1 = time.perf_counter()
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens = list(output.token_ids) if output.finished else tokens
        # The first token came with the prefill step: the rest are one decode step each.
        out.append({"prefill_tok_s": len(prefill_prompt) / prefill_s,
                    "decode_tok_s": (len(tokens) - 1) / (time.perf_counter() - t1)})
    return {"rounds": out, "tokens": tokens, **medians(out)}


def simd_path(system_info: str) -> str:
    """The widest x86 SIMD path in llama.cpp's system info ("... | AVX2 = 1 | ... | AVX512 = 0 | ...")."""
    flags = {k.strip(): v.strip() for k, _, v in (part.partition("=") for part in system_info.split("|"))}
    flags = {k.split(":")[-1].strip(): v for k, v in flags.items()}
    for name, label in (("AVX512", "AVX-512"), ("AVX2", "AVX2")):
        if flags.get(name) == "1":
            return label
    return "no AVX2"


def medians(rounds: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in rounds) for key in ("prefill_tok_s", "decode_tok_s")}
