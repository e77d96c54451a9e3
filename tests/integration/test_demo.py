"""The README's first command: `infinilm demo` serves real requests with SmolLM2 through the real stack (which it
starts, or here reuses) and prints every committed result. Run as a user runs it, in a process of its own."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.integration.worker_harness import INFINILM, REPO, make_topics, write_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_the_demo_answers_every_request_and_shows_what_it_says(tmp_path, make_topic, unique_name, kafka_bootstrap,
                                                               redis_url):
    # Topics of its own, so nothing else produced to the default ones can reach it.
    config = write_config(tmp_path / "demo.yaml", model="smollm2", topics=make_topics(make_topic),
                          group=unique_name("group"), bootstrap=kafka_bootstrap, redis_url=redis_url)
    run = subprocess.run([*INFINILM, "demo", "--config", str(config)], cwd=REPO, capture_output=True, text=True,
                         timeout=540, env={**os.environ, "COLUMNS": "240"})
    out = run.stdout
    assert run.returncode == 0, (out[-6000:], run.stderr[-4000:])
    assert "all answered in" in out and "missing" not in out and "got no result" not in out, out
    assert "the deltas add up to the result's text" in out, out
    assert "[ignored: max_token]" in out, out  # the misspelt key, named back
    assert "prompt_too_long" in out and "dead-letter records for undecodable input: 1" in out, out
    assert "Traceback" not in out + run.stderr, run.stderr[-4000:]
