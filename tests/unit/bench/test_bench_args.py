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
