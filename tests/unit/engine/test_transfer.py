"""engine.transfer.to_device, and the step path's use of it instead of blocking uploads."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.transfer import to_device

CPU = torch.device("cpu")
# Modules whose code runs while a step is built or launched: a blocking host-to-device copy there
# would make the host wait for the steps already queued on a GPU.
STEP_PATH = ["engine/model_runner.py", "engine/sampler.py", "engine/attention/triton_kernels.py",
             "engine/attention/triton_backend.py", "engine/attention/flash_backend.py",
             "engine/attention/kv_int8.py", "engine/attention/masks.py", "engine/cuda_graphs.py"]


def test_to_device_on_the_cpu_keeps_values_and_types():
    assert to_device([1, 2, 3], CPU).dtype == torch.int64
    assert to_device([0.5, 2], CPU, torch.float16).dtype == torch.float16
    array = np.arange(4, dtype=np.int64)
    shared = to_device(array, CPU)
    array[0] = 9
    assert shared.tolist() == [9, 1, 2, 3]  # no copy on the CPU
    t = torch.ones(2, dtype=torch.int32)
    assert to_device(t, CPU) is t and to_device(t, CPU, torch.int64).dtype == torch.int64


@pytest.mark.parametrize("path", STEP_PATH)
def test_the_step_path_makes_no_blocking_uploads(path):
    """No torch.tensor(..., device=...) and no .to(device) without non_blocking in the step path."""
    tree = ast.parse((Path(__file__).resolve().parents[3] / path).read_text())
    offenders = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        keywords = {k.arg for k in node.keywords}
        name = node.func.attr
        if name == "tensor" and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch" \
                and "device" in keywords:
            offenders.append(node.lineno)
        if name == "to" and node.args and isinstance(node.args[0], (ast.Name, ast.Attribute)) \
                and "device" in ast.unparse(node.args[0]) and "non_blocking" not in keywords:
            offenders.append(node.lineno)
    assert not offenders, f"{path}: blocking uploads at lines {offenders}; use engine.transfer.to_device"


def test_to_device_stages_lists_on_the_host_under_a_default_device():
    """Under `with torch.device(...)` a bare torch.tensor() would land on that device, where it cannot be
    pinned; the staging tensor is made on the host whatever the default device is."""
    with torch.device("meta"):
        got = to_device([3, 1, 2], torch.device("cpu"), torch.long)
    assert got.device.type == "cpu" and got.dtype == torch.long and got.tolist() == [3, 1, 2]
