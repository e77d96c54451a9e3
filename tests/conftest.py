"""Shared fixtures: tiny random-weight models written by the tests themselves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=320, max_position_embeddings=512)


# With no pool size given, an engine on the CPU takes 40% of host RAM for its KV pool, capped at 2 GiB
# (EngineOptions.cpu_kv_cache_cap_bytes), and zeroes and lists every block as it starts: 262k blocks of a tiny
# model. The suite's in-process engines are capped at this instead (64k blocks of a tiny model, about 700 of
# SmolLM2's) unless a test sets the pool or the cap itself; workers and ranks in processes of their own keep
# the product's default.
SUITE_KV_CACHE_CAP = 512 << 20


@pytest.fixture(autouse=True)
def suite_kv_cache_cap(monkeypatch):
    from engine import engine_core
    from engine.config import EngineConfig

    product_cap, plan = EngineConfig().cpu_kv_cache_cap_bytes, engine_core.plan_cache_layout

    def planned(cfg, *args):
        if cfg.cpu_kv_cache_cap_bytes == product_cap:
            cfg = cfg.replace(cpu_kv_cache_cap_bytes=SUITE_KV_CACHE_CAP)
        return plan(cfg, *args)

    monkeypatch.setattr(engine_core, "plan_cache_layout", planned)


def pytest_collection_modifyitems(config, items):
    """Across pytest-xdist processes (ops/dev.sh test), files start in collection order: the files holding
    slow or reference tests (some a minute or two each) go first, so that none starts last, with the other
    process idle. A serial run keeps the usual order."""
    if not (config.getoption("numprocesses", None) or os.environ.get("PYTEST_XDIST_WORKER")):
        return
    heavy = {item.path for item in items if item.get_closest_marker("slow") or item.get_closest_marker("reference")}
    items.sort(key=lambda item: item.path not in heavy)  # stable: each file's own order is kept


@pytest.fixture(autouse=True)
def torch_threads_kept():
    """Each test starts on the process's thread count, whatever the one before set (an engine's num_threads).
    The count sets summation orders, and with them load-time choices: SmolLM2's calibrated fp8 perplexity
    is 0.35% apart on 1 and 2 threads, so a test must not inherit another's."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def write_tiny_model(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Save a random-weight HF model of the given family (llama, qwen2, qwen3) as safetensors."""
    import torch
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    shape = {**TINY_SHAPE, **overrides}
    if arch == "qwen3":
        shape.setdefault("head_dim", 32)
    config = config_cls(**shape, bos_token_id=1, eos_token_id=2, tie_word_embeddings=shape.pop("tie", False)
                        if "tie" in shape else False)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so the test sees them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0, 0.02)
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path)
    return path


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer without merges: ids 0-2 are specials, then one id per byte."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<s>assistant: {% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "chat_template": template}))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture
def decode_layers_calls(monkeypatch) -> list[int]:
    """Rows of each call of the one-call decoder (decode_layers) from here on; the real kernel still runs."""
    from engine.kernels.cpu_build import cpu_kernels

    ops, calls = cpu_kernels(), []
    if ops is not None:
        real = ops.decode_layers
        monkeypatch.setattr(ops, "decode_layers", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    return calls


@pytest.fixture(params=["avx512", "avx2"])
def kernel_isa(request, monkeypatch) -> str:
    """Runs a test once per SIMD path of the CPU kernels (engine/kernels/cpu_build.py): within it the engine's
    kernels are the module built for that instruction set, as INFINILM_CPU_ISA would pick. A path this host's CPU
    cannot run skips, named in the summary; the AVX2 path runs on every x86 host."""
    from engine.kernels import cpu_build

    isa = request.param
    if isa not in cpu_build.runnable_isas():
        pytest.skip(f"this host lacks {isa.upper()}: the {isa} kernel path is not run here")
    monkeypatch.setenv(cpu_build.ISA_ENV, isa)
    cpu_build.cpu_kernels.cache_clear()
    assert cpu_build.cpu_kernels().vector_lanes() == (16 if isa == "avx512" else 8)
    yield isa
    cpu_build.cpu_kernels.cache_clear()  # the environment is restored next: the following call loads its module
