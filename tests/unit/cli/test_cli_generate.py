"""`infinilm generate`: output on a tiny model, and one-line errors with exit code 2 for bad input."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from cli import app

runner = CliRunner()


def test_generate_prints_json_with_the_requested_number_of_tokens(tiny_llama):
    result = runner.invoke(app, ["generate", "--model", str(tiny_llama), "--prompt", "hello", "--max-tokens", "5",
                                 "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["completion_tokens"] == len(out["token_ids"])
    assert (out["finish_reason"], out["completion_tokens"]) in {("length", 5), *(("stop", n) for n in range(1, 6))}


def test_an_unknown_model_is_one_line_and_exit_code_2(tmp_path):
    result = runner.invoke(app, ["generate", "--model", str(tmp_path / "missing"), "--prompt", "hi"])
    assert result.exit_code == 2
    assert "unknown model" in result.output and "Traceback" not in result.output


def test_a_broken_config_json_is_one_line_and_exit_code_2(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    result = runner.invoke(app, ["generate", "--model", str(tmp_path), "--prompt", "hi"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error") and "Traceback" not in result.output


def test_bad_sampling_parameters_are_invalid_request(tiny_llama):
    result = runner.invoke(app, ["generate", "--model", str(tiny_llama), "--prompt", "hi", "--top-p", "0"])
    assert result.exit_code == 2 and "invalid_request" in result.output
