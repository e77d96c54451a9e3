"""Constraints applied to the logits before a token is picked.

Banned phrases: a phrase is banned as the token sequences it can be written
with (as given, with a leading space, capitalised). When the tokens generated
so far end with all but the last token of such a sequence, that last token is
masked out, so the phrase cannot be completed in that form. Phrases that come
out under another tokenisation are caught by the worker's rule check.
"""

from __future__ import annotations

import torch


def phrase_token_sequences(tokenizer, phrases: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    seqs: set[tuple[int, ...]] = set()
    for phrase in phrases:
        variants = {phrase, " " + phrase, phrase[:1].upper() + phrase[1:], " " + phrase[:1].upper() + phrase[1:]}
        for text in variants:
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                seqs.add(ids)
    return tuple(sorted(seqs))


def banned_next_tokens(history: list[int], sequences: tuple[tuple[int, ...], ...]) -> list[int]:
    banned = []
    for seq in sequences:
        k = len(seq) - 1
        if k == 0 or (len(history) >= k and tuple(history[-k:]) == seq[:-1]):
            banned.append(seq[-1])
    return banned


def apply_bans(logits: torch.Tensor, bans: list[list[int]]) -> None:
    """Mask banned tokens in place; bans[i] lists the tokens banned for row i."""
    for row, tokens in enumerate(bans):
        if tokens:
            logits[row, tokens] = float("-inf")
