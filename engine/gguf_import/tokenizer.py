"""The GGUF's vocabulary as a HF `tokenizers` tokenizer: byte-level BPE, or SentencePiece-style BPE."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from engine.gguf_import.metadata import GGUFImportError, GGUFMetadata

_LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# How llama.cpp pre-splits text for each `tokenizer.ggml.pre` value (llama-vocab.cpp). "digits"
# splits every digit off first, then applies the GPT-2 pattern, as the StarCoder family does.
# NOTE: HF transformers' GGUF loader applies plain GPT-2 for "smollm"; that differs when a run of
# spaces precedes a digit ("  1"). We follow llama.cpp, which matches SmolLM2's own tokenizer.json.
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "mpt", "olmo", "jais"), "gpt2"),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), "digits"
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "smaug-bpe", "dbrx"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), _QWEN2_SPLIT),
}
# llama.cpp takes a whole pre-token that is in the vocabulary before trying merges for these, and
# adds BOS unless the file says otherwise.
_LLAMA3_FAMILY = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral"})
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 2, 3, 4


def _byte_alphabet() -> dict[int, str]:
    # GPT-2's printable spelling of the 256 bytes: printable latin-1 bytes stand for themselves,
    # the rest are shifted to code points from 256 upwards in byte order.
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelling = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in spelling)
    for n, b in enumerate(shifted):
        spelling[b] = chr(256 + n)
    return spelling


def build_tokenizer(meta: GGUFMetadata) -> tuple[Tokenizer, dict[str, Any]]:
    """Rebuild the tokenizer a GGUF describes: a `tokenizers.Tokenizer` and tokenizer_config.json."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(meta, tokens, types)
        add_bos_default = meta.get("tokenizer.ggml.pre") in _LLAMA3_FAMILY
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(meta, tokens, types)
        add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies without the flag
    else:
        raise GGUFImportError(
            f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)"
        )
    special = {
        "bos_token": "bos_token_id",
        "eos_token": "eos_token_id",
        "unk_token": "unknown_token_id",
        "pad_token": "padding_token_id",
    }
    names = {
        key: tokens[i]
        for key, id_key in special.items()
        if (i := meta.get(f"tokenizer.ggml.{id_key}")) is not None
    }
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    _set_post_processor(tokenizer, kind, names, add_bos, add_eos)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **names,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{meta.get('general.architecture')}.context_length", 2048)),
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return tokenizer, config


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int]) -> None:
    # llama.cpp matches control and user-defined tokens whole in raw text; without this they would
    # be cut into pieces. Their vocabulary entries keep the raw spelling, so ids stay the same.
    special = [t for t, k in zip(tokens, types, strict=True) if k in (_TOKEN_CONTROL, _TOKEN_UNKNOWN)]
    user = [t for t, k in zip(tokens, types, strict=True) if k == _TOKEN_USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _byte_level_bpe(meta: GGUFMetadata, tokens: list[str], types: list[int]) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    split = _PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        raise GGUFImportError(
            f"unsupported tokenizer.ggml.pre {pre!r}; supported: {sorted(_PRE_TOKENIZER_SPLITS)}"
        )
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind not in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNKNOWN) and not set(token) <= spelled:
            token = "".join(alphabet[b] for b in token.encode("utf-8"))  # stored as raw text
        vocab.setdefault(token, i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre in _LLAMA3_FAMILY,
        )
    )
    if split == "gpt2":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == "digits":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    _add_special_tokens(tokenizer, tokens, types)
    return tokenizer


def _sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    # SentencePiece BPE merges the adjacent pair whose union scores highest; a BPE merge list ranked
    # by the score of the merged piece does the same. Ties: longer left piece, then vocabulary order.
    ids = {
        t: i
        for i, (t, k) in enumerate(zip(tokens, types, strict=True))
        if k in (_TOKEN_NORMAL, _TOKEN_USER_DEFINED)
    }
    ranked = []
    for merged, i in ids.items():
        pairs = [
            (merged[:cut], merged[cut:])
            for cut in range(1, len(merged))
            if merged[:cut] in ids and merged[cut:] in ids
        ]
        pairs.sort(key=lambda p: (ids[p[0]], ids[p[1]]))
        ranked.extend((scores[i], len(left), len(right), left, right) for left, right in pairs)
    ranked.sort(key=lambda r: r[:3], reverse=True)
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_bpe(meta: GGUFMetadata, tokens: list[str], types: list[int]) -> Tokenizer:
    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges")]
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            raise GGUFImportError(
                "SentencePiece GGUF has neither tokenizer.ggml.merges nor tokenizer.ggml.scores"
            )
        merges = _sentencepiece_merges(tokens, scores, types)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    _add_special_tokens(tokenizer, tokens, types)
    return tokenizer


def _set_post_processor(
    tokenizer: Tokenizer, kind: str, names: dict[str, str], add_bos: bool, add_eos: bool
) -> None:
    steps = []
    if kind == "gpt2":
        steps.append(processors.ByteLevel(trim_offsets=False))
    bos = names.get("bos_token") if add_bos else None
    eos = names.get("eos_token") if add_eos else None
    if bos or eos:
        prefix, suffix = (f"{bos}:0 " if bos else ""), (f" {eos}:0" if eos else "")
        pair_prefix, pair_suffix = (f" {bos}:1" if bos else ""), (f" {eos}:1" if eos else "")
        specials = [(t, tokenizer.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
        steps.append(
            processors.TemplateProcessing(
                single=f"{prefix}$A:0{suffix}",
                pair=f"{prefix}$A:0{suffix}{pair_prefix} $B:1{pair_suffix}",
                special_tokens=specials,
            )
        )
    if len(steps) == 1:
        tokenizer.post_processor = steps[0]
    elif steps:
        tokenizer.post_processor = processors.Sequence(steps)
