"""A first build of the CPU kernels compiles for a long while: it says so on stderr and in the log while it runs;
a cached load, which returns at once, shows nothing (engine/kernels/cpu_build.py, status_while_slow). The cache
is kept per torch install, so two checkouts on one machine do not rebuild it for each other."""

from __future__ import annotations

import logging
import time

from engine.kernels import cpu_build


def test_a_slow_block_shows_its_description_with_the_time_elapsed_and_logs_it(capsys, caplog):
    caplog.set_level(logging.INFO, logger=cpu_build.__name__)
    with cpu_build.status_while_slow("building the test kernels", after=0.05):
        time.sleep(0.5)
    err = capsys.readouterr().err
    assert "building the test kernels" in err and "0:00:00" in err, err
    assert [r.getMessage() for r in caplog.records] == ["building the test kernels"]


def test_a_quick_block_shows_nothing(capsys, caplog):
    caplog.set_level(logging.INFO, logger=cpu_build.__name__)
    with cpu_build.status_while_slow("building the test kernels", after=5.0):
        pass
    assert capsys.readouterr().err == "" and not caplog.records


def test_the_status_ends_with_a_block_that_raises(capsys):
    try:
        with cpu_build.status_while_slow("building the test kernels", after=0.05):
            time.sleep(0.3)
            raise RuntimeError("compiler missing")
    except RuntimeError:
        pass
    assert "building the test kernels" in capsys.readouterr().err


def test_each_torch_install_gets_its_own_build_directory(monkeypatch):
    """ninja rebuilds when the compile command changes, and the command names torch's include paths: two venvs
    (a checkout and CI's clone) sharing one build directory would rebuild it for each other on every run."""
    here = cpu_build.module_name("baseline")
    assert here == cpu_build.module_name("baseline") and here.startswith("infinilm_cpu_kernels_baseline_")
    monkeypatch.setattr(cpu_build.torch, "__file__", "/elsewhere/venv/site-packages/torch/__init__.py")
    elsewhere = cpu_build.module_name("baseline")
    assert elsewhere != here and elsewhere.startswith("infinilm_cpu_kernels_baseline_")
