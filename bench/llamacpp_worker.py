"""llama.cpp's single-stream prefill and decode rates on a GGUF file: bench.single_stream's peer row.

Runs inside .venv-llamacpp (bench/llamacpp_env.sh), not the engine's environment: it imports only the standard
library and llama_cpp. Reads one JSON job on stdin (gguf, threads, prefill_prompt and decode_prompt as token ids,
decode_tokens, rounds) and prints one JSON line: the version and, per round, prefill and decode tokens per second,
with the greedy tokens of the last round's decode for the caller to compare.
"""

from __future__ import annotations

import json
import sys
import time

import llama_cpp


def main() -> None:
    job = json.load(sys.stdin)
    prefill, decode = job["prefill_prompt"], job["decode_prompt"]
    n_ctx = max(len(prefill), len(decode) + job["decode_tokens"]) + 16
    llm = llama_cpp.Llama(model_path=job["gguf"], n_threads=job["threads"], n_threads_batch=job["threads"],
                          n_ctx=n_ctx, n_batch=512, n_ubatch=512, verbose=False)
    llm.eval(prefill[:16])  # warm-up: first-touch of the weights and buffers
    rounds, tokens = [], []
    for _ in range(job["rounds"]):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prefill)
        prefill_s = time.perf_counter() - t0
        # generate() evaluates the prompt, yields a token, then evaluates each yielded token on the next step:
        # from the first token on, one step per token, as the engine's decode steps.
        gen = llm.generate(decode, top_k=1, temp=0.0, reset=True)
        tokens = [next(gen)]
        t1 = time.perf_counter()
        for token in gen:
            tokens.append(token)
            if len(tokens) > job["decode_tokens"]:
                break
        decode_s = time.perf_counter() - t1
        rounds.append({"prefill_tok_s": len(prefill) / prefill_s, "decode_tok_s": (len(tokens) - 1) / decode_s})
    # The features this build uses (e.g. "AVX2 = 1 | AVX512 = 0"): which SIMD path the peer row ran.
    system = llama_cpp.llama_print_system_info().decode(errors="replace")
    print(json.dumps({"version": llama_cpp.__version__, "system_info": system, "rounds": rounds, "tokens": tokens}))


if __name__ == "__main__":
    main()
