"""Perplexity of a text under the engine, with a sliding window.

The text is cut into windows of `context` tokens that start `stride` tokens apart (the last one
ends at the text's end). Every token but the first is scored exactly once: in the first window
that contains it after the previous window's end, given the tokens of that window before it.
PPL = exp(mean negative log-likelihood). This is the procedure of the Hugging Face guide "Perplexity
of fixed-length models", with each window's tokens counted exactly (the guide's loop subtracts
one label per window even where the internal shift loses none).

Each window is one request whose prompt positions are scored (SamplingParams.score_positions), so
the windows batch through the engine like any other work, and the numbers include whatever the
engine does to them: quantized weights, an int8 KV cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from engine.llm import LLM
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Window:
    begin: int  # first token of the window
    end: int  # one past its last token
    first_scored: int  # first token scored here (absolute position)


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float
    num_scored: int
    num_windows: int
    context: int
    stride: int


def sliding_windows(num_tokens: int, context: int, stride: int) -> list[Window]:
    if context < 2 or not 1 <= stride <= context:
        raise ValueError(f"need context >= 2 and 1 <= stride <= context; got context={context}, stride={stride}")
    windows: list[Window] = []
    prev_end = 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + context, num_tokens)
        first = max(prev_end, begin + 1)
        if first < end:
            windows.append(Window(begin, end, first))
        prev_end = end
        if end == num_tokens:
            break
    return windows


def window_nll(log_probs: dict[int, float], window: Window) -> list[float]:
    return [-log_probs[p - window.begin] for p in range(window.first_scored, window.end)]


def perplexity(llm: LLM, token_ids: list[int], context: int = 1024, stride: int = 512,
               progress: Callable[[int, int], None] | None = None, batch: int = 16) -> PerplexityResult:
    """Sliding-window perplexity of `token_ids` under the engine; `batch` windows are in flight at once."""
    windows = sliding_windows(len(token_ids), context, stride)
    nll: list[float] = []
    for i in range(0, len(windows), batch):
        group = windows[i:i + batch]
        prompts = [token_ids[w.begin:w.end] for w in group]
        params = [SamplingParams(max_tokens=1, temperature=0,
                                 score_positions=tuple(range(w.first_scored - w.begin, w.end - w.begin)))
                  for w in group]
        for w, out in zip(group, llm.generate(prompts, params), strict=True):
            if out.error is not None:
                raise out.error
            nll.extend(window_nll(out.prompt_logprobs or {}, w))
        if progress:
            progress(min(i + batch, len(windows)), len(windows))
    mean = sum(nll) / max(1, len(nll))
    return PerplexityResult(math.exp(mean), mean, len(nll), len(windows), context, stride)
