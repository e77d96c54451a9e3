"""`--help` on every command: it runs, every option and argument says what it is for, and no paragraph
of a command's text carries a line break of its source (the help renderer keeps them, mid-sentence)."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from cli import app

runner = CliRunner()


def commands(command=None, path=("infinilm",)):
    command = command or typer.main.get_command(app)
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from commands(sub, (*path, name))


ALL = list(commands())


@pytest.mark.parametrize(("path", "command"), ALL, ids=[" ".join(p) for p, _ in ALL])
def test_help_runs_and_says_what_each_option_is_for(path, command):
    result = runner.invoke(app, [*path[1:], "--help"])
    assert result.exit_code == 0, result.output
    assert f"Usage: {' '.join(path)}" in result.output
    assert command.help, "no command text"
    broken = [p for p in command.help.split("\n\n") if "\n" in p.strip()]
    assert not broken, broken
    silent = [p.name for p in command.params if p.name != "help" and not getattr(p, "help", None)]
    assert not silent, f"options without help: {silent}"
