"""bench.kernel_resources compiles the Triton kernels for sm_90 here, with no GPU, and reads their resources.

It runs in a subprocess: this test process may run the same kernels under TRITON_INTERPRET=1
(tests/unit/test_triton_kernels.py), and a process decorates its kernels one way only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Slow tier (compiles the Triton kernels): `ops/dev.sh test --fast` leaves it out.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_every_kernel_compiles_for_hopper_and_the_rope_kernel_does_not_spill():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "bench.kernel_resources", "--json"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    usage = report["kernels"]
    assert set(usage) == {"llama3-8b", "smollm2"}
    for kernels in usage.values():
        assert set(kernels) == {"rope_kv", "decode", "decode (split)", "add_rms_norm", "silu_mul"}
        assert all(0 < k["registers"] <= 255 for k in kernels.values())
        assert kernels["rope_kv"]["local"] == 0 and kernels["rope_kv"]["stack"] == 0
    launches = report["decode_launches_llama3_8b"]
    assert len(launches) == 8
    # Fewer blocks per iteration hold fewer K/V rows in registers.
    assert launches["pages=1 warps=4"]["registers"] < launches["pages=4 warps=4"]["registers"]


def test_it_refuses_to_run_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "bench.kernel_resources"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "TRITON_INTERPRET=1 is set" in done.stderr
