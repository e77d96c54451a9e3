"""Calibration data, and the per-layer input statistics gathered by running it through the model.

The default calibration text is real English prose held out from our evaluation text: the Apache
2.0 and MPL 2.0 licences (engine/quant/calibration.txt). Perplexity is measured on GPL-3, which
calibration never sees. Point `calibration_file` at text (or JSONL) that looks like the traffic;
the seed article's garbled customer-service numbers came from calibrating on the wrong data.

What each linear layer needs from calibration is the second moment of its inputs,
H = sum_t x_t^T x_t: a layer's output error for a weight error E is sum_n E_n H E_n^T, so scales can
be chosen by output error without keeping the activations. The mean |x| per input channel drives
activation-aware scaling.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention.metadata import AttentionMetadata, PrefillSpan
from engine.errors import ModelLoadError
from engine.models.linear import Linear
from engine.models.llama import LlamaForCausalLM

DEFAULT_CALIBRATION_FILE = Path(__file__).with_name("calibration.txt")
# Calibration tokens by weight bits. Running them through the model and accumulating every layer's
# x^T x is most of the time calibration takes. int8's searches only rank a few candidates per
# layer; int4's error feedback (GPTQ) inverts H, which wants more rows than the widest layer has
# inputs. Quality at these sizes: docs/BENCHMARKS.md, "Quantization".
CALIBRATION_TOKENS = {8: 1024, 4: 2048}
CALIBRATION_SEQ_LEN = 512
Progress = Callable[[int, int, str], None]


@dataclass
class LayerStats:
    gram: torch.Tensor  # [K, K] fp32: sum over calibration rows of x^T x
    abs_sum: torch.Tensor  # [K]: sum of |x|
    rows: int = 0

    @property
    def hessian(self) -> torch.Tensor:
        """The mean of x^T x: output error of a weight error E is E H E^T per output channel."""
        return self.gram / max(1, self.rows)

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(1, self.rows)

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.gram.addmm_(x.t(), x)
        self.abs_sum.add_(x.abs().sum(0))
        self.rows += x.shape[0]


def read_calibration_texts(path: str | Path | None = None) -> list[str]:
    """Texts from a .txt file (one text) or a .jsonl file (per line: `text`, `prompt` + `completion`,
    or chat `messages`, returned as dicts for the caller to render)."""
    path = Path(path) if path is not None else DEFAULT_CALIBRATION_FILE
    if not path.is_file():
        raise ModelLoadError(f"calibration file {path} does not exist")
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"calibration file {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at "
                             f"offset {exc.start})") from None
    if path.suffix.lower() != ".jsonl":
        return [content]
    texts = []
    for n, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path}:{n}: not JSON ({exc})") from None
        if isinstance(record, dict) and isinstance(record.get("text"), str):
            texts.append(record["text"])
        elif isinstance(record, dict) and isinstance(record.get("prompt"), str):
            texts.append(record["prompt"] + str(record.get("completion", "")))
        elif isinstance(record, dict) and isinstance(record.get("messages"), list):
            texts.append(record["messages"])
        else:
            raise ModelLoadError(f"{path}:{n}: expected an object with text, prompt or messages")
    if not texts:
        raise ModelLoadError(f"calibration file {path} holds no records")
    return texts


def calibration_sequences(tokenizer, path: str | Path | None = None, seq_len: int = CALIBRATION_SEQ_LEN,
                          max_tokens: int = CALIBRATION_TOKENS[8]) -> list[list[int]]:
    """Token sequences of at most `seq_len` tokens, `max_tokens` in all, cut from the calibration
    texts and, when they hold more, taken evenly spaced across them (not just from the start)."""
    pieces: list[list[int]] = []
    for text in read_calibration_texts(path):
        if isinstance(text, list):
            ids = tokenizer.encode(tokenizer.apply_chat_template(text, add_generation_prompt=False),
                                   add_special_tokens=False)
        else:
            ids = tokenizer.encode(text)
        pieces.extend(p for start in range(0, len(ids), seq_len) if len(p := ids[start:start + seq_len]) >= 2)
    total = sum(map(len, pieces))
    if total > max_tokens:
        step = total / max_tokens
        chosen, seen = [], 0
        for p in pieces:  # keep a piece when the running count crosses the next multiple of `step`
            if int((seen + len(p)) / step) > int(seen / step) or not chosen:
                chosen.append(p)
            seen += len(p)
        pieces = chosen
    return first_tokens(pieces, max_tokens)


def first_tokens(sequences: list[list[int]], budget: int) -> list[list[int]]:
    """The leading sequences, the last one cut, holding `budget` tokens in all (no piece under 2 tokens)."""
    out = []
    for seq in sequences:
        if budget < 2:
            break
        out.append(seq[:budget])
        budget -= len(out[-1])
    return out


def linear_modules(model: LlamaForCausalLM) -> dict[str, torch.nn.Module]:
    """Every linear layer that quantization replaces, by its module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


def lm_head_name(model: LlamaForCausalLM) -> str:
    """The module whose weight is the LM head: `lm_head`, or the tied `embed_tokens`."""
    return "embed_tokens" if model.lm_head is None else "lm_head"


@torch.inference_mode()
def collect_statistics(model: LlamaForCausalLM, sequences: list[list[int]], block_size: int = 16,
                       progress: Progress | None = None) -> dict[str, LayerStats]:
    """Run each sequence through the full-precision model (one causal prefill) and accumulate
    every linear layer's input statistics, and the LM head's (the final hidden states)."""
    cfg = model.config
    device = model.norm.weight.device
    stats: dict[str, LayerStats] = {}
    hooks = []

    def stat_for(name: str, width: int) -> LayerStats:
        if name not in stats:
            stats[name] = LayerStats(torch.zeros(width, width, device=device), torch.zeros(width, device=device))
        return stats[name]

    for name, module in linear_modules(model).items():
        if name == "lm_head":
            continue  # fed by the final norm, captured below like the tied head
        hooks.append(module.register_forward_pre_hook(
            lambda m, args, name=name: stat_for(name, m.in_features).add(args[0])))
    head = lm_head_name(model)
    hooks.append(model.norm.register_forward_hook(
        lambda m, args, out: stat_for(head, cfg.hidden_size).add(out)))
    try:
        for i, seq in enumerate(sequences):
            causal_prefill(model, seq, block_size, device)
            if progress:
                progress(i + 1, len(sequences), "calibration")
    finally:
        for h in hooks:
            h.remove()
    return stats


def causal_prefill(model: LlamaForCausalLM, ids: list[int], block_size: int, device: torch.device) -> torch.Tensor:
    """One causal prefill of `ids` in a cache of its own; the final hidden states."""
    cfg = model.config
    n = len(ids)
    blocks = -(-n // block_size)
    dtype = model.norm.weight.dtype
    caches = [torch.zeros(2, blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
              for _ in range(cfg.num_layers)]
    rows = torch.arange(n, device=device)
    meta = AttentionMetadata(slot_mapping=rows, prefills=[
        PrefillSpan(token_start=0, num_tokens=n, num_cached=0, block_table=torch.arange(blocks, device=device))])
    return model(torch.tensor(ids, device=device), rows, caches, meta)
