"""`infinilm kernels build`: the CPU kernel modules built (or found) ahead of the first request, one line each;
a bad choice or a failed build is one line and a non-zero exit."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from engine.kernels import cpu_build

runner = CliRunner()


@pytest.mark.slow
def test_all_builds_every_instruction_set_this_cpu_runs_and_names_each_module():
    result = runner.invoke(app, ["kernels", "build", "--all"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == list(cpu_build.runnable_isas())
    for isa, line in zip(cpu_build.runnable_isas(), lines, strict=True):
        path = Path(line.rsplit(": ", 1)[1])
        assert " ready in " in line and path.is_file() and path.name.startswith(cpu_build.module_name(isa))


@pytest.mark.parametrize(("args", "message"), [
    (["--isa", "sse9"], "expected one of avx512, avx2, baseline"),
    (["--isa", "avx2", "--all"], "give --isa or --all, not both"),
])
def test_a_bad_choice_is_one_line_and_exit_code_2(args, message):
    result = runner.invoke(app, ["kernels", "build", *args])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, result.output


def test_an_instruction_set_above_the_host_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "flags : fpu avx2 fma")
    result = runner.invoke(app, ["kernels", "build", "--isa", "avx512"])
    assert result.exit_code == 2, result.output
    assert "--isa avx512: this CPU cannot run avx512; this CPU's best is 'avx2'" in result.output


def test_a_build_that_fails_says_why_and_exits_1(monkeypatch, tmp_path):
    """No usable compiler (CXX names one that fails), in an empty build cache: the engine would run torch's ops."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    result = runner.invoke(app, ["kernels", "build", "--isa", "baseline"])
    assert result.exit_code == 1, result.output
    assert "could not be built (baseline:" in result.output and "falls back to torch's ops" in result.output
