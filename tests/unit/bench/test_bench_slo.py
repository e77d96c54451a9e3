"""bench.slo's arithmetic: Poisson schedules, the per-request metrics and what counts as meeting the SLO."""

from __future__ import annotations

import itertools

import pytest

from bench.slo import Slo, Step, Timings, arrivals, goodput, step_of


def test_arrivals_are_a_seeded_poisson_process_at_the_rate():
    a = arrivals(2.0, 4000, seed=1)
    assert a == arrivals(2.0, 4000, seed=1) and a != arrivals(2.0, 4000, seed=2)
    assert all(x < y for x, y in itertools.pairwise(a))
    assert a[-1] / len(a) == pytest.approx(0.5, rel=0.05)  # mean gap 1/rate


def step(rate: float, *timings: Timings) -> Step:
    return Step("ours", rate, 10.0, {f"r{i}": t for i, t in enumerate(timings)})


def test_tpot_spreads_the_time_after_the_first_token_over_the_tokens_after_it():
    s = step(1.0, Timings(first_token=0.5, last_token=1.4, done=1.5, tokens=10))
    assert s.p(50, "tpot") == pytest.approx(0.1)
    assert s.p(50, "ttft") == 0.5 and s.p(50, "e2e") == 1.5


def test_a_step_meets_the_slo_only_with_every_request_answered_and_the_p99_limits_held():
    slo = Slo(ttft_p99_s=2.0, tpot_p99_s=0.1, e2e_p99_s=30.0)
    fast = Timings(first_token=0.5, last_token=1.0, done=1.1, tokens=11)
    assert step(1.0, fast, fast).meets(slo)
    assert not step(1.0, fast, Timings()).meets(slo)  # one never answered
    assert not step(1.0, fast, Timings(first_token=2.5, last_token=3.0, done=3.1, tokens=11)).meets(slo)
    assert not step(1.0, fast, Timings(first_token=0.5, last_token=3.0, done=3.1, tokens=11)).meets(slo)
    assert not step(1.0, fast, Timings(done=0.2, error="deadline_exceeded")).meets(slo)
    # Without streaming only end-to-end latency counts.
    assert step(1.0, Timings(done=29.0, tokens=5)).meets_e2e(slo)
    assert not step(1.0, Timings(done=31.0, tokens=5)).meets_e2e(slo)


def test_goodput_is_the_highest_rate_that_passes():
    slo = Slo()
    ok, slow = Timings(first_token=0.1, last_token=0.5, done=0.6, tokens=5), Timings(first_token=5.0, done=6.0)
    steps = [step(0.5, ok), step(1.0, ok), step(2.0, slow)]
    assert goodput(steps, lambda s: s.meets(slo)) == 1.0
    assert goodput([step(0.5, slow)], lambda s: s.meets(slo)) == 0.0


def test_merged_runs_take_each_system_from_the_last_file_that_has_it(tmp_path):
    import json

    from bench.slo import merge_runs

    def run(path, slo, *systems):
        steps = [{"system": name, "rate": rate, "wall_s": 1.0, "lag": None,
                  "timings": {"r0": {"sent": 0.0, "first_token": 0.1, "last_token": 0.5, "done": 0.6, "tokens": 5,
                                     "error": None}}} for name, rate in systems]
        path.write_text(json.dumps({"slo": slo, "steps": steps}))
        return path

    slo = {"ttft_p99_s": 2.0, "tpot_p99_s": 0.1, "e2e_p99_s": 30.0}
    a = run(tmp_path / "a.json", slo, ("ours", 1.0), ("ours", 2.0), ("ceiling", 1.0))
    b = run(tmp_path / "b.json", {**slo, "e2e_p99_s": 20.0}, ("ceiling", 1.0), ("ceiling", 3.0))
    steps, merged_slo = merge_runs([a, b])
    assert [(s.system, s.rate) for s in steps] == [("ours", 1.0), ("ours", 2.0), ("ceiling", 1.0), ("ceiling", 3.0)]
    assert merged_slo.e2e_p99_s == 20.0 and steps[0].timings["r0"].tokens == 5


def test_every_system_at_one_step_gets_the_same_prompts_and_each_step_its_own():
    # The prompts' seed comes from the step alone: a long-lived worker must not meet a prompt from an earlier
    # step (its prefix cache would hit), while the systems compared at one step must see the same text.
    assert step_of("dynamic_bucket-1.5") == step_of("ceiling-1.5") == step_of("hf-1.5") == "1.5"
    assert step_of("fifo-overload") == "overload"
    assert len({step_of(f"direct-{r:g}") for r in (0.25, 0.5, 1, 1.5, 2, 3)}) == 6
