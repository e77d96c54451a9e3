"""The service config's `parallel` section reaches the engine, and its bad combinations fail at load."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.config import load_config
from worker.config_types import ConfigError

EXAMPLE = Path(__file__).resolve().parents[3] / "config.yaml"


def test_the_example_config_runs_one_rank():
    engine = load_config(EXAMPLE, env={}).engine_config()
    assert engine.tensor_parallel_size == 1 and engine.collective_timeout_s == 120


def test_tensor_parallel_size_comes_from_the_file_or_the_environment(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("parallel: {tensor_parallel_size: 2, collective_timeout_s: 30}\n")
    assert load_config(path, env={}).engine_config().tensor_parallel_size == 2
    env = {"INFINILM__PARALLEL__TENSOR_PARALLEL_SIZE": "4"}
    engine = load_config(path, env=env).engine_config()
    assert (engine.tensor_parallel_size, engine.collective_timeout_s) == (4, 30)


@pytest.mark.parametrize(("text", "message"), [
    ("parallel: {tensor_parallel_size: 0}\n", "parallel.tensor_parallel_size"),
    ("parallel: {collective_timeout_s: 0}\n", "parallel.collective_timeout_s"),
    ("parallel: {tensor_parallel_size: 2}\nexecution: {async_scheduling: true}\n", "runs steps synchronously"),
])
def test_bad_parallel_settings_fail_when_the_config_loads(tmp_path, text, message):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path, env={}).engine_config()
