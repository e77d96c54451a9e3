"""bench/llamacpp_peer.py: a missing llama.cpp environment is reported with the command that creates it, and the
engine's side of the peer table measures what it says on a real (tiny) engine."""

from __future__ import annotations

import pytest

from bench import llamacpp_peer
from engine import LLM
from tests.conftest import write_tiny_model


def test_a_missing_environment_says_how_to_create_it(monkeypatch, tmp_path):
    monkeypatch.setattr(llamacpp_peer, "VENV", tmp_path / "no-venv")
    with pytest.raises(llamacpp_peer.PeerMissing, match=r"bench/llamacpp_env.sh"):
        llamacpp_peer.llamacpp_rates(tmp_path / "m.gguf", 2, [1, 2, 3], [1, 2], 4, 1)


@pytest.mark.slow
def test_engine_rates_time_a_prefill_and_the_decode_steps(tmp_path):
    llm = LLM(model=str(write_tiny_model(tmp_path / "llama", "llama")), dtype="float32", num_kv_blocks=64)
    rates = llamacpp_peer.engine_rates(llm, list(range(3, 103)), list(range(3, 20)), decode_tokens=6, rounds=2)
    assert len(rates["rounds"]) == 2 and len(rates["tokens"]) == 7
    assert rates["prefill_tok_s"] > 0 and rates["decode_tok_s"] > 0
    from bench.prefill_precision import prefill_rate

    assert prefill_rate(llm, list(range(3, 103)), rounds=2) > 0
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(("info", "path"), [
    ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 1 | AVX512_VBMI = 1 | ", "AVX-512"),
    ("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 0 | LLAMAFILE = 1 | ", "AVX2"),
    ("AVX = 1 | AVX2 = 0 | ", "no AVX2"),
    ("", "no AVX2"),
])
def test_the_peer_row_names_the_simd_path_of_the_llamacpp_build(info, path):
    assert llamacpp_peer.simd_path(info) == path
