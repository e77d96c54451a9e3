"""Where SmolLM2's fp8 KV perplexity goes: E4M3 round trips on K, V or both, per-head absmax scales, with and
without a 64-point Hadamard rotation of the stored rows, against an fp32 cache.

    PYTHONPATH=. .venv/bin/python -m bench.kv_fp8_numerics [--tokens 4096]

The round trips are applied to each layer's rotated K and V just before attention over an fp32 cache, on
the torch reference backend: what every read of an fp8 cache sees (the `K+V` row equals `infinilm eval ppl
--cache-bits 8 --cache-format fp8`). A rotation H is orthogonal, so storing H k and reading it back as
H^T(stored) is what attention would compute with H q against the stored H k: the question is whether
spreading each head's outlier channels over all of head_dim lets E4M3's 3 mantissa bits cost less. The
engine's order (kv_key_rotation: q rotated too, K stored rotated) computes the same in exact arithmetic, and
sign-flipped rotations are orthogonal too; their rows show how much fp32 operation order and the choice of H move
this measure.
Prints a table and writes bench/results/kv_fp8_numerics.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from engine.attention.key_rotation import hadamard
from engine.attention.kv_int8 import quantize_fp8
from engine.quant.kv_scales import absmax_scales, collect_kv, kv_calibration_sequences

TEXT = Path("/usr/share/common-licenses/GPL-3")
RESULTS = Path(__file__).resolve().parent / "results" / "kv_fp8_numerics.json"
# name -> (round trip on K, on V, rotate K, rotate V, rotate q instead of K back, sign-flip seed)
ARMS = {"fp32": (False, False, False, False, False, None), "K+V": (True, True, False, False, False, None),
        "K only": (True, False, False, False, False, None), "V only": (False, True, False, False, False, None),
        "K+V, K and V rotated": (True, True, True, True, False, None),
        "K+V, K rotated": (True, True, True, False, False, None),
        # What the engine does (kv_key_rotation): q rotated as well, the stored K left rotated.
        "K+V, q and K rotated (the engine's order)": (True, True, True, False, True, None),
        **{f"K+V, q and K rotated, H with random signs (seed {seed})": (True, True, True, False, True, seed)
           for seed in (0, 1, 2)}}


def signed_hadamard(n: int, seed: int | None) -> torch.Tensor:
    """H, or diag(random signs) H: orthogonal either way."""
    h = hadamard(n)
    if seed is None:
        return h
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1
    return signs.view(-1, 1) * h


class RoundTrip:
    """A layer's attention backend, fed K and V as an fp8 cache with `scales` would return them."""

    def __init__(self, inner, scales: list[torch.Tensor | None], rotations: list[torch.Tensor | None],
                 rotate_q: bool) -> None:
        self.inner, self.scales, self.rotations, self.rotate_q = inner, scales, rotations, rotate_q

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, q, k, v, kv_cache, meta):
        if self.rotate_q:
            r = self.rotations[0]
            q, k = (q.float() @ r).to(q.dtype), (k.float() @ r).to(k.dtype)
            k = stored(k, self.scales[0], None)
            v = v if self.scales[1] is None else stored(v, self.scales[1], self.rotations[1])
        else:
            k, v = (x if s is None else stored(x, s, r)
                    for x, s, r in zip((k, v), self.scales, self.rotations, strict=True))
        return self.inner.forward(q, k, v, kv_cache, meta)


def stored(x: torch.Tensor, scales: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    y = x.float() if rotation is None else x.float() @ rotation
    y = quantize_fp8(y, scales).float() * scales.view(-1, 1)
    return (y if rotation is None else y @ rotation.T).to(x.dtype)


def main() -> None:
    from engine import LLM
    from engine.perplexity import perplexity

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    llm = LLM("smollm2", dtype="float32", attention_backend="torch", max_model_len=1025,
              max_num_batched_tokens=2048, enable_prefix_caching=False)
    model = llm.engine.model
    kv = collect_kv(model, kv_calibration_sequences(llm.tokenizer, None, 1025), 16)
    ids = llm.tokenizer.encode(TEXT.read_text())[:args.tokens]
    backend = model.layers[0].self_attn.backend
    rows = []
    for name, (on_k, on_v, rot_k, rot_v, rotate_q, seed) in ARMS.items():
        h = signed_hadamard(model.config.head_dim, seed)
        for layer, (k, v) in zip(model.layers, kv, strict=True):
            rotations = [h if rot_k else None, h if rot_v else None]
            scales = [absmax_scales(x if r is None else x @ r) if on else None
                      for x, r, on in zip((k, v), rotations, (on_k, on_v), strict=True)]
            layer.self_attn.backend = RoundTrip(backend, scales, rotations, rotate_q)
        ppl = perplexity(llm, ids, 1024, 512).perplexity
        rows.append({"arm": name, "perplexity": round(ppl, 4),
                     "vs_fp32_pct": round((ppl / rows[0]["perplexity"] - 1) * 100, 2) if rows else 0.0})
        print(f"{name:56s} {ppl:8.4f} {rows[-1]['vs_fp32_pct']:+6.2f}%", flush=True)
    RESULTS.write_text(json.dumps({"tokens": len(ids), "context": 1024, "stride": 512, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
