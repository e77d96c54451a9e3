"""`python -m cli`: the `infinilm` command without the installed console script."""

from cli import app

app(prog_name="infinilm")
