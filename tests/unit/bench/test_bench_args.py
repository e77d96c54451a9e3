"""The shared options of the alternating decode-step benchmarks (bench.kv_decode.parse_args)."""

import sys

import pytest
import torch

from bench.kv_decode import parse_args


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_a_benchmark_adds_its_own_option(monkeypatch, restore_threads):
    monkeypatch.setattr(sys, "argv", ["bench", "--kv-only", "--batches", "32", "48", "--threads", "1"])
    args = parse_args("doc", [1, 8], "page sizes",
                      extra=lambda ap: ap.add_argument("--kv-only", action="store_true"))
    assert args.kv_only is True
    assert args.batches == [32, 48]
    assert torch.get_num_threads() == 1


def test_without_the_extra_option_it_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench", "--kv-only"])
    with pytest.raises(SystemExit):
        parse_args("doc", [1, 8], "page sizes")
    assert "--kv-only" in capsys.readouterr().err


def test_bad_counts_get_a_clear_error(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench", "--rounds", "0"])
    with pytest.raises(SystemExit, match="--rounds >= 1"):
        parse_args("doc", [1, 8], "page sizes")


def test_a_runs_command_line_names_the_environment_that_changes_what_it_runs(monkeypatch):
    from bench import report

    monkeypatch.setattr(sys, "argv", ["single_stream.py", "--rounds", "3"])
    monkeypatch.delenv("INFINILM_CPU_ISA", raising=False)
    monkeypatch.delenv("LLAMACPP_VENV", raising=False)
    assert report.invocation("bench.single_stream").endswith("-m bench.single_stream --rounds 3")
    assert "INFINILM_CPU_ISA" not in report.invocation("bench.single_stream")
    monkeypatch.setenv("INFINILM_CPU_ISA", "avx2")
    monkeypatch.setenv("LLAMACPP_VENV", ".venv-llamacpp-avx2")
    assert report.invocation("bench.single_stream").startswith(
        "INFINILM_CPU_ISA=avx2 LLAMACPP_VENV=.venv-llamacpp-avx2 ")
