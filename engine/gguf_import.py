"""Import a GGUF checkpoint as a Hugging Face-format model folder.

The engine loads one format only: a folder with `config.json`, `model.safetensors`, `tokenizer.json`
and `tokenizer_config.json`. A GGUF file is turned into such a folder once, offline, by
`import_gguf`. Quantized weights are dequantized (through `gguf.quants`) to a float dtype; the
engine's own quantization works from there.

NOTE: llama.cpp stores the attention q/k rows of the `llama` architecture interleaved for its RoPE
layout; we undo that here, so the folder matches what HF transformers would have written. The qwen
architectures use neox RoPE in llama.cpp and are stored unpermuted.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# Bump when the folder written for the same GGUF changes, so cached imports are redone.
IMPORTER_VERSION = 1
IMPORT_INFO_FILE = "gguf_import.json"

ProgressCallback = Callable[[int, int, str], None]
"""Called after each tensor as `progress(done, total, hf_tensor_name)`."""

SUPPORTED_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_TYPE_NAMES = "F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K Q4_K Q5_K Q6_K"
SUPPORTED_TENSOR_TYPES = frozenset(QType[name] for name in _TYPE_NAMES.split())
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Consumed into config.json (llama3-style RoPE scaling), not a weight HF models have.
_ROPE_FREQS = "rope_freqs.weight"


class GGUFImportError(ValueError):
    """The GGUF file uses something this importer cannot translate faithfully."""


@dataclass(frozen=True)
class _TensorPlan:
    hf_name: str
    tensor: Any  # gguf.ReaderTensor
    shape: tuple[int, ...]
    unpermute_heads: int | None  # head count to undo llama.cpp's RoPE row order with


class _Metadata:
    def __init__(self, reader: gguf.GGUFReader) -> None:
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFImportError(f"GGUF metadata lacks required key {key!r}")
        return value


def import_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: str = "float32",
    progress: ProgressCallback | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the GGUF model at `gguf_path` as an HF-format folder at `out_dir` and return its path.

    The folder holds config.json, model.safetensors (weights dequantized to `dtype`: float32,
    float16 or bfloat16), tokenizer.json, tokenizer_config.json, generation_config.json and
    gguf_import.json (provenance). It is built in a temporary sibling folder and renamed into place,
    so an interrupted import never leaves a partial `out_dir`. An existing non-empty `out_dir` is
    replaced only with `overwrite=True`. Raises GGUFImportError for unsupported architectures,
    tensor types or tokenizers.
    """
    src = Path(gguf_path)
    out = Path(out_dir).expanduser().absolute()
    if dtype not in _TORCH_DTYPES:
        raise GGUFImportError(f"dtype must be one of {sorted(_TORCH_DTYPES)}, not {dtype!r}")
    if _is_nonempty_dir(out) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass overwrite=True to replace it")

    reader = gguf.GGUFReader(src)
    meta = _Metadata(reader)
    arch = meta.require("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFImportError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(SUPPORTED_ARCHS)}")
    tensors = {t.name: t for t in reader.tensors}
    config = _build_config(meta, arch, tensors, dtype)
    plan = _plan_tensors(arch, config, tensors)
    tokenizer, tokenizer_config = _build_tokenizer(meta)
    generation_config = _build_generation_config(meta)
    import_info = {
        "importer_version": IMPORTER_VERSION,
        "source": src.name,
        "source_size": src.stat().st_size,
        "dtype": dtype,
        "tensor_types": sorted({QType(t.tensor_type).name for t in reader.tensors}),
    }

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.importing-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the model folder should not be
        _write_safetensors(tmp / "model.safetensors", plan, _TORCH_DTYPES[dtype], progress)
        tokenizer.save(str(tmp / "tokenizer.json"))
        for name, payload in (
            ("config.json", config),
            ("tokenizer_config.json", tokenizer_config),
            ("generation_config.json", generation_config),
            (IMPORT_INFO_FILE, import_info),
        ):
            (tmp / name).write_text(
                json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
            )
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


@contextlib.contextmanager
def console_progress(description: str) -> Iterator[ProgressCallback]:
    """A rich progress bar on stderr, as a ProgressCallback for `import_gguf`."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _is_nonempty_dir(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def _move_into_place(tmp: Path, out: Path) -> None:
    if not _is_nonempty_dir(out):
        os.replace(tmp, out)  # also replaces an empty directory
        return
    # A directory cannot be renamed over a non-empty one: move the old one aside first, so `out`
    # is missing only between two renames and never half written.
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.replace(out, old / "model")
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------- config


def _short_float(value: float) -> float:
    # GGUF stores float32; print the shortest decimal that round-trips it (1e-05, not 9.9999997e-06).
    return float(str(np.float32(value)))


def _head_count(meta: _Metadata, key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if value is None:
        raise GGUFImportError(f"GGUF metadata lacks required key {key!r}")
    if isinstance(value, list):  # per-layer counts; only uniform ones fit an HF config
        if len(set(value)) != 1:
            raise GGUFImportError(f"{key} varies per layer ({sorted(set(value))}); not supported")
        value = value[0]
    return int(value)


def _build_config(meta: _Metadata, arch: str, tensors: dict[str, Any], dtype: str) -> dict[str, Any]:
    hidden = int(meta.require(f"{arch}.embedding_length"))
    n_head = _head_count(meta, f"{arch}.attention.head_count")
    n_kv = _head_count(meta, f"{arch}.attention.head_count_kv", n_head)
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // n_head)
    if "token_embd.weight" not in tensors:
        raise GGUFImportError("GGUF has no token_embd.weight tensor")
    vocab_size = int(tensors["token_embd.weight"].shape[1])
    has_q_bias = "blk.0.attn_q.bias" in tensors
    config: dict[str, Any] = {
        "architectures": [SUPPORTED_ARCHS[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "rms_norm_eps": _short_float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _short_float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch, tensors, head_dim),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if arch == "llama":
        config.update(attention_bias=has_q_bias, mlp_bias=False, pretraining_tp=1)
    else:
        config.update(
            use_sliding_window=False, sliding_window=None, max_window_layers=config["num_hidden_layers"]
        )
        if arch == "qwen3":
            config["attention_bias"] = has_q_bias
    return config


def _rope_scaling(
    meta: _Metadata, arch: str, tensors: dict[str, Any], head_dim: int
) -> dict[str, Any] | None:
    if _ROPE_FREQS in tensors:
        return _llama3_rope_scaling(meta, arch, tensors[_ROPE_FREQS], head_dim)
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor") or meta.get(f"{arch}.rope.scale_linear")
    if kind is None and factor is not None:
        kind = "linear"  # older files only wrote rope.scale_linear
    if kind in (None, "none") or not factor or factor == 1.0:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _short_float(factor)}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if kind == "yarn":
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        # llama.cpp's attn_factor multiplies its own mscale, unlike HF's attention_factor: not mapped.
        for name in ("beta_fast", "beta_slow"):
            value = meta.get(f"{arch}.rope.scaling.yarn_{name}")
            if value is not None:
                scaling[name] = _short_float(value)
    elif kind != "linear":
        raise GGUFImportError(f"unsupported RoPE scaling type {kind!r} (supported: linear, yarn, llama3)")
    return scaling


def _llama3_rope_scaling(meta: _Metadata, arch: str, tensor: Any, head_dim: int) -> dict[str, Any]:
    # llama.cpp replaces Llama 3.1's rope_scaling by the per-frequency factors it implies. They do
    # not store the parameters, so assume the values every Llama 3.x release uses (low 1, high 4,
    # original context 8192) with the largest factor, and refuse the file unless they reproduce it.
    stored = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).reshape(-1)
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    dim = int(meta.get(f"{arch}.rope.dimension_count") or head_dim)
    scaling = {
        "rope_type": "llama3",
        "factor": _short_float(stored.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if not np.allclose(_llama3_rope_factors(scaling, theta, dim), stored, rtol=1e-5, atol=1e-6):
        raise GGUFImportError(
            "rope_freqs.weight does not match llama3 RoPE scaling with low=1, high=4, original=8192"
        )
    return scaling


def _llama3_rope_factors(scaling: dict[str, Any], theta: float, dim: int) -> np.ndarray:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors)


def _build_generation_config(meta: _Metadata) -> dict[str, Any]:
    eos = meta.get("tokenizer.ggml.eos_token_id")
    # Chat models end a turn with EOT (e.g. Llama 3's <|eot_id|>), which differs from EOS.
    stops = [
        i
        for i in (eos, meta.get("tokenizer.ggml.eot_token_id"), meta.get("tokenizer.ggml.eom_token_id"))
        if i is not None
    ]
    stops = list(dict.fromkeys(stops))
    config: dict[str, Any] = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": stops[0] if len(stops) == 1 else (stops or None),
    }
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        config["pad_token_id"] = pad
    return config


# ----------------------------------------------------------------------------- weights


def _plan_tensors(arch: str, config: dict[str, Any], tensors: dict[str, Any]) -> list[_TensorPlan]:
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    plan = []
    for name, tensor in tensors.items():
        if name == _ROPE_FREQS:
            continue
        hf_name = _hf_tensor_name(name)
        if QType(tensor.tensor_type) not in SUPPORTED_TENSOR_TYPES:
            raise GGUFImportError(
                f"tensor {name} has unsupported type {QType(tensor.tensor_type).name}; "
                f"supported: {sorted(t.name for t in SUPPORTED_TENSOR_TYPES)}"
            )
        heads = None
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = n_head if ".attn_q." in name else n_kv
        plan.append(_TensorPlan(hf_name, tensor, tuple(int(d) for d in reversed(tensor.shape)), heads))
    return plan


def _hf_tensor_name(name: str) -> str:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    raise GGUFImportError(f"GGUF tensor {name!r} has no Hugging Face equivalent known to this importer")


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of q/k rows (pass the kv head count for k)."""
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise GGUFImportError(f"cannot unpermute {rows} rows across {n_heads} heads")
    return (
        weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _dequantize(item: _TensorPlan) -> np.ndarray:
    t = item.tensor
    array = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(item.shape)
    if item.unpermute_heads is not None:
        array = unpermute_rope_rows(array, item.unpermute_heads)
    return array


def _write_safetensors(
    path: Path, plan: list[_TensorPlan], dtype: torch.dtype, progress: ProgressCallback | None
) -> None:
    # Written by hand rather than with safetensors.save_file: every shape is known from the GGUF
    # header, so the file header goes first and tensors stream after it one at a time. Memory stays
    # at one dequantized tensor instead of the whole float model.
    itemsize = torch.tensor([], dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in plan:
        nbytes = math.prod(item.shape) * itemsize
        header[item.hf_name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(item.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # keeps tensor data 8-byte aligned, as safetensors does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for done, item in enumerate(plan, 1):
            array = _dequantize(item)
            if dtype != torch.float32:
                array = torch.from_numpy(np.array(array)).to(dtype).view(torch.uint8).numpy()
            f.write(np.ascontiguousarray(array).tobytes())
            if progress is not None:
                progress(done, len(plan), item.hf_name)
        f.flush()
        os.fsync(f.fileno())


# ----------------------------------------------------------------------------- tokenizer

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


def _build_tokenizer(meta: _Metadata) -> tuple[Tokenizer, dict[str, Any]]:
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


def _byte_level_bpe(meta: _Metadata, tokens: list[str], types: list[int]) -> Tokenizer:
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


def _sentencepiece_bpe(meta: _Metadata, tokens: list[str], types: list[int]) -> Tokenizer:
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
