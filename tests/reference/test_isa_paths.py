"""The CPU kernels' instruction-set paths: INFINILM_CPU_ISA caps what they are built for, and the AVX2 path,
the one every x86 host without AVX-512 takes, passes the engine's reference checks against HF transformers on
every x86 host (on an AVX-512 host through the cap, in a process of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.kernels import cpu_build

pytestmark = pytest.mark.reference

REPO = Path(__file__).resolve().parents[2]
AVX512 = "flags : fpu avx2 fma avx512f avx512bw avx512vl avx512dq"
AVX2 = "flags : fpu avx2 fma"


@pytest.mark.parametrize(("cpu", "env", "isa", "has", "lacks"), [
    (AVX512, "", "avx512", ["-DCPU_CAPABILITY_AVX512"], ["-mno-avx512f"]),
    (AVX512, "avx2", "avx2", ["-mno-avx512f", "-DCPU_CAPABILITY_AVX2"], ["-DCPU_CAPABILITY_AVX512"]),
    (AVX512, "AVX512", "avx512", ["-DCPU_CAPABILITY_AVX512"], ["-mno-avx512f"]),
    (AVX2, "", "avx2", ["-DCPU_CAPABILITY_AVX2"], ["-mno-avx512f", "-DCPU_CAPABILITY_AVX512"]),
    (AVX2, "baseline", "baseline", ["-mno-avx2", "-mno-fma"], ["-DCPU_CAPABILITY_AVX2"]),
], ids=["avx512-host", "avx512-host-capped", "avx512-named", "avx2-host", "avx2-host-capped"])
def test_the_cap_picks_the_isa_and_its_flags(monkeypatch, cpu, env, isa, has, lacks):
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: cpu)
    monkeypatch.setenv(cpu_build.ISA_ENV, env)
    assert cpu_build.target_isa() == isa
    flags = cpu_build.build_flags()
    assert all(f in flags for f in has) and not any(f in flags for f in lacks), flags


def test_a_cap_above_the_host_or_an_unknown_name_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: AVX2)
    monkeypatch.setenv(cpu_build.ISA_ENV, "avx512")
    with pytest.raises(ValueError, match="this CPU's best is 'avx2'"):
        cpu_build.target_isa()
    monkeypatch.setenv(cpu_build.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="expected one of avx512, avx2, baseline"):
        cpu_build.target_isa()


@pytest.mark.skipif(cpu_build.host_isa() == "baseline", reason="this host has no AVX2")
def test_the_cap_builds_and_loads_the_avx2_module():
    env = {**os.environ, cpu_build.ISA_ENV: "avx2", "PYTHONPATH": str(REPO)}
    probe = subprocess.run(
        [sys.executable, "-c", "from engine.kernels.cpu_build import cpu_kernels, target_isa; "
                               "print(target_isa(), cpu_kernels().panel_gemm_available(), cpu_kernels().vector_lanes())"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert probe.stdout.split() == ["avx2", "True", "8"], probe.stderr[-3000:]


@pytest.mark.skipif(cpu_build.host_isa() == "baseline", reason="this host has no AVX2")
@pytest.mark.skipif(cpu_build.target_isa() == "avx2", reason="this process's kernels are the AVX2 path already: "
                    "tests/reference/test_engine_reference.py runs these checks on them here")
def test_the_avx2_path_passes_the_reference_checks():
    """tests/reference/test_engine_reference.py's HF comparisons (tiny models through every backend, SmolLM2's
    greedy tokens on prepacked and compact panels), run in a process whose kernels are built for AVX2: the same
    kernels as AVX-512's, 8 lanes wide."""
    env = {**os.environ, cpu_build.ISA_ENV: "avx2", "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/reference/test_engine_reference.py",
         # SmolLM2's `plain` arm is left out: its linears are torch's, and the tiny models' checks cover the attention.
         "-k", "logits_match_hf_through_the_scheduler or (smollm2_greedy_tokens_equal_hf and prepacked) "
               "or compact_panels_give_bitwise"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-2000:]


@pytest.mark.parametrize(("preset", "expected_mkl"), [(None, "AVX2"), ("AVX", "AVX")])
def test_the_cap_reaches_the_libraries_kernels_too(preset, expected_mkl):
    """Under INFINILM_CPU_ISA=avx2, importing the engine caps MKL and oneDNN at AVX2 (a value the user set wins):
    oneDNN then reports no bf16 support, as on a host without AVX-512, so bf16 prefill is refused too."""
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")}
    env.update({cpu_build.ISA_ENV: "avx2", "PYTHONPATH": str(REPO)})
    if preset is not None:
        env["MKL_ENABLE_INSTRUCTIONS"] = preset
    probe = subprocess.run(
        [sys.executable, "-c", "import os, engine, torch; from engine.kernels.cpu_build import bf16_matmul_isa; "
                               "print(os.environ['MKL_ENABLE_INSTRUCTIONS'], os.environ['ONEDNN_MAX_CPU_ISA'], "
                               "torch.ops.mkldnn._is_mkldnn_bf16_supported(), bf16_matmul_isa())"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert probe.stdout.split() == [expected_mkl, "AVX2", "False", "None"], probe.stderr[-3000:]
