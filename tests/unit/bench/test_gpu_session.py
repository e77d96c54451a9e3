"""bench/gpu_session.sh: the GGUF travels in two halves and is joined byte for byte on the device, and the run
hands gpu_check the joined file only once both halves are there."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from bench.gpu_check import SECTIONS

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "gpu_session.sh"


def session(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    shim = tmp_path / "bin"
    shim.mkdir(exist_ok=True)
    # The device's python3 stands in as a shim that records gpu_check's arguments (imports succeed: no wheels).
    (shim / "python3").write_text(f'#!/bin/sh\n[ "$1" = -c ] && exit 0\necho "$@" >> {tmp_path}/calls\n')
    (shim / "python3").chmod(stat.S_IRWXU)
    full_env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}", "GPU_SESSION_DIR": str(tmp_path / "dev"),
                "GPU_SESSION_PART_BYTES": "700", "GPU_SESSION_WHEELS": "0", "OUT": str(tmp_path / "out"), **env}
    return subprocess.run(["bash", str(SCRIPT), *args], env=full_env, capture_output=True, text=True, timeout=60)


def test_prepare_splits_in_two_and_run_joins_only_when_both_halves_are_there(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(os.urandom(1200))
    prepared = session(tmp_path, "prepare", str(gguf))
    assert prepared.returncode == 0, prepared.stderr
    dev = tmp_path / "dev"
    parts = sorted(dev.glob("smollm2.gguf.part-*"))
    assert [p.stat().st_size for p in parts] == [700, 500]
    assert str(parts[0]) in prepared.stdout and str(parts[1]) in prepared.stdout  # the carry lists to use
    # The printed calls run every section of gpu_check once, each call's budget inside its timeout.
    lines = prepared.stdout.splitlines()
    runs = [(line.split()[2], float(line.split()[-1]), int(lines[i - 1].split("timeout_s ")[1].split(",")[0]))
            for i, line in enumerate(lines) if line.strip().startswith("bench/gpu_session.sh run")]
    sections = [s for names, _, _ in runs for s in names.split(",")]
    assert sorted(sections) == sorted(SECTIONS) and len(runs) == 2
    assert all(budget < timeout for _, budget, timeout in runs) and sum(t for *_, t in runs) < 900

    second = parts[1].read_bytes()
    parts[1].unlink()  # the first call: one half has come
    first = session(tmp_path, "run", "kernels,decode_sweep")
    assert first.returncode == 0, first.stderr
    assert not (dev / "smollm2.gguf").exists()
    parts[1].write_bytes(second)  # the second call: the other half has come
    later = session(tmp_path, "run", "weight_formats", "--quick")
    assert later.returncode == 0, later.stderr
    assert (dev / "smollm2.gguf").read_bytes() == gguf.read_bytes()

    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0] == "-m bench.gpu_check --sections kernels,decode_sweep --name gpu_check-kernels-decode_sweep"
    assert calls[1] == (f"-m bench.gpu_check --sections weight_formats --name gpu_check-weight_formats "
                        f"--smollm2-gguf {dev}/smollm2.gguf --quick")
    assert (tmp_path / "out" / "gpu_check-weight_formats.log").exists()


def test_prepare_refuses_a_file_that_does_not_split_in_two(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(os.urandom(2500))
    result = session(tmp_path, "prepare", str(gguf))
    assert result.returncode == 2 and "expected two GGUF parts, got 4" in result.stderr
