"""A tensor-parallel rank that dies or hangs fails the whole engine promptly, with a line that names it,
and leaves no process behind; a rank 0 that dies takes its ranks with it."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.errors import EngineFailure
from tests.conftest import write_tiny_model
from worker.engine_loop import EngineLoop, EngineThread

# A step here takes milliseconds: each failure must show within seconds, far below the collective timeout
# the tests give the group (except where the hang itself is the subject).
PROMPT_S = 5.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tp-faults"), "llama", seed=5)


@pytest.fixture
def started():
    """Every engine a test starts is closed after it, whatever the test's outcome: one group per process."""
    engines: list[LLM] = []
    yield engines
    for llm in engines:
        llm.close()


def _engine(path: Path, timeout_s: float = 60.0, started: list | None = None) -> LLM:
    llm = LLM(model=str(path), dtype="float32", device="cpu", tensor_parallel_size=2, num_kv_blocks=32,
              block_size=16, collective_timeout_s=timeout_s)
    if started is not None:
        started.append(llm)
    return llm


def _rank1() -> multiprocessing.Process:
    (proc,) = multiprocessing.active_children()
    return proc


def _step_until_failure(llm: LLM, hurt, after_steps: int = 3) -> tuple[EngineFailure, float]:
    """Step a long generation, hurt rank 1 after a few steps; the failure and the seconds it took."""
    llm.engine.add_request("long", list(range(10, 40)), SamplingParams(max_tokens=400, ignore_eos=True))
    hurt_at = None
    for step in range(1000):
        if step == after_steps:
            hurt()
            hurt_at = time.monotonic()
        try:
            llm.engine.step()
        except EngineFailure as exc:
            assert hurt_at is not None, f"failed before rank 1 was touched: {exc}"
            return exc, time.monotonic() - hurt_at
    raise AssertionError("the engine kept stepping with rank 1 gone")


def test_a_rank_killed_mid_run_fails_the_engine_promptly_and_names_it(tiny, caplog, started):
    llm = _engine(tiny, started=started)
    rank1 = _rank1()
    exc, took = _step_until_failure(llm, lambda: os.kill(rank1.pid, signal.SIGKILL))
    assert took < PROMPT_S
    assert f"tensor-parallel rank 1 (pid {rank1.pid}) exited with code -9" in str(exc)
    assert "must be restarted" in str(exc)
    assert any(r.levelname == "CRITICAL" and f"pid {rank1.pid}" in r.getMessage() for r in caplog.records)
    with pytest.raises(EngineFailure):  # it stays failed: no step runs on a partial group
        llm.engine.step()
    llm.close()
    assert not multiprocessing.active_children()


def test_a_hung_rank_fails_the_engine_after_the_collective_timeout(tiny, started):
    llm = _engine(tiny, timeout_s=2.0, started=started)
    rank1 = _rank1()
    exc, took = _step_until_failure(llm, lambda: os.kill(rank1.pid, signal.SIGSTOP))
    assert 1.5 < took < 2.0 + PROMPT_S, took
    assert "the engine cannot continue" in str(exc)
    llm.close()
    assert not multiprocessing.active_children()  # the stopped rank was killed, not left behind


def test_a_rank_dying_while_the_engine_is_idle_shows_without_a_step(tiny, started):
    llm = _engine(tiny, started=started)
    rank1 = _rank1()
    llm.engine.check_health()
    os.kill(rank1.pid, signal.SIGKILL)
    deadline = time.monotonic() + PROMPT_S
    while True:
        try:
            llm.engine.check_health()
        except EngineFailure as exc:
            assert f"rank 1 (pid {rank1.pid}) exited with code -9" in str(exc)
            break
        assert time.monotonic() < deadline, "no failure within the deadline"
        time.sleep(0.05)
    llm.close()


def test_the_worker_engine_loop_dies_and_reports_when_a_rank_dies(tiny, started):
    llm = _engine(tiny, started=started)
    rank1 = _rank1()
    reported: list[BaseException] = []
    loop = EngineLoop(llm.engine, deliver=lambda event: None, idle_wait_s=0.01, thread=EngineThread())
    loop.on_failure = reported.append
    loop.start()
    assert loop.alive
    os.kill(rank1.pid, signal.SIGKILL)
    deadline = time.monotonic() + PROMPT_S
    while loop.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not loop.alive
    assert isinstance(loop.failed, EngineFailure) and reported == [loop.failed]
    llm.close()


def test_the_ranks_exit_when_rank_0_is_killed(tiny):
    script = textwrap.dedent(f"""
        import multiprocessing, sys, time
        from engine import LLM
        if __name__ == "__main__":
            llm = LLM(model={str(tiny)!r}, dtype="float32", device="cpu", tensor_parallel_size=2,
                      num_kv_blocks=32)
            print(multiprocessing.active_children()[0].pid, flush=True)
            time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        child = int(proc.stdout.readline())
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + PROMPT_S
        while _running(child):
            assert time.monotonic() < deadline, f"rank 1 (pid {child}) outlived its rank 0"
            time.sleep(0.05)
    finally:
        proc.kill()


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whoever adopts it, maybe late)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_a_checkpoint_that_fails_to_load_fails_start_up_and_leaves_no_rank(tiny, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.errors import ModelLoadError

    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)
    weights = next(broken.glob("*.safetensors"))
    tensors = load_file(str(weights))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError, match=r"lacks weights for: layers\.1\.mlp\.down_proj\.weight"):
        _engine(broken)
    assert time.monotonic() - t0 < 30
    assert not multiprocessing.active_children()


def test_a_script_without_a_main_guard_is_told_why_its_rank_died(tiny, tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(f"from engine import LLM\n"
                      f"LLM(model={str(tiny)!r}, dtype='float32', device='cpu', tensor_parallel_size=2)\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode != 0
    assert "tensor-parallel rank 1 exited while starting" in run.stderr
    assert "if __name__ == \"__main__\":" in run.stderr
