"""Faults at scale: workers killed, the broker restarted, Redis stopped, bad input; lost and duplicated counted.

    .venv/bin/python -m bench.chaos                    # every scenario, bigger loads (not yet timed)
    .venv/bin/python -m bench.chaos --quick            # the test suite's loads, to check the script
    .venv/bin/python -m bench.chaos --only kills,fuzz  # some scenarios
    .venv/bin/python -m bench.chaos --quick --only kills,sigterm --repeat 10 --cpu-hogs 2
                                                       # rebalance races on a starved host

The scenarios are those of tests/fault (tests.fault.scenarios, tests.fault.fuzz_run),
run against real `infinilm worker` processes on the shared local stack; the
broker scenarios start a private broker of their own, so the shared one is never
stopped. "lost" counts requests without a committed result, "duplicated" ids
with more than one, both from a read_committed audit of the results topic made
after the workers stopped; "crashed" counts worker processes that exited without
being told to, or did not exit cleanly on SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback

from bench.report import (
    REPO,
    console,
    invocation,
    markdown_table,
    print_table,
    update_docs_section,
    write_json,
)

# name -> (full load, --quick load): keyword arguments of the scenario function.
SHORT = {"max_tokens": (8, 48)}
SCENARIOS = {
    "kills": ("worker_kills", {"requests": 1500, "kills": 6, "rate": 20.0, **SHORT},
              {"requests": 500, "kills": 3, "rate": 20.0, **SHORT}),
    "broker": ("broker_restart", {"requests": 600, "down_s": 15.0, "rate": 12.0, **SHORT},
               {"requests": 150, "down_s": 5.0, "rate": 12.0, **SHORT}),
    "broker-kill": ("broker_restart", {"requests": 600, "down_s": 15.0, "hard": True, "rate": 12.0, **SHORT},
                    {"requests": 150, "down_s": 5.0, "hard": True, "rate": 12.0, **SHORT}),
    "redis": ("redis_outage", {"requests": 600, "down_s": 20.0, "rate": 12.0, **SHORT},
              {"requests": 150, "down_s": 8.0, "rate": 12.0, **SHORT}),
    "redis-hang": ("redis_outage", {"requests": 600, "down_s": 20.0, "hang": True, "rate": 12.0, **SHORT},
                   {"requests": 150, "down_s": 8.0, "hang": True, "rate": 12.0, **SHORT}),
    "long": ("long_generations", {"concurrent": 8, "max_tokens": 250},
             {"concurrent": 2, "max_tokens": 192, "max_poll_interval_ms": 2000}),
    "sigterm": ("sigterm_under_load", {"requests": 1000, "rate": 20.0, "max_tokens": (16, 64)},
                {"requests": 300, "rate": 20.0, "max_tokens": (16, 64)}),
    "fuzz": ("fuzz", {"total": 30_000, "rounds": 10}, {"total": 10_000}),
}


def run_one(name: str, site, seed: int, quick: bool):
    from tests.fault import fuzz_run, scenarios
    from tests.fault.scenarios import Outcome

    func, full, small = SCENARIOS[name]
    kwargs = dict(small if quick else full)
    if func == "long_generations":
        from engine.model_registry import ModelNotFoundError, resolve_model

        try:
            kwargs["model"] = str(resolve_model("smollm2"))
        except ModelNotFoundError as exc:
            return Outcome(name, "-", "-", 0, 0, 0, 0.0, failures=[f"skipped: {exc}"])
    else:
        kwargs["seed"] = seed
    module = fuzz_run if func == "fuzz" else scenarios
    started = time.monotonic()
    try:
        return getattr(module, func)(site, **kwargs)
    except Exception as exc:  # one broken scenario must not cost the others' numbers
        console.print(f"[red]{name} failed:[/]\n{traceback.format_exc()}")
        return Outcome(name, str(kwargs), "-", -1, -1, -1, time.monotonic() - started,
                       failures=[f"raised {type(exc).__name__}: {exc}"])

RELIABILITY = REPO / "docs" / "reliability.md"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the test suite's loads")
    ap.add_argument("--only", default=",".join(SCENARIOS), help=f"comma-separated, of: {', '.join(SCENARIOS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, help="run each scenario this many times (seeds seed, seed+1, ...)")
    ap.add_argument("--cpu-hogs", type=int, default=0,
                    help="busy-loop processes running beside the workers, to starve them of CPU as a loaded host does")
    args = ap.parse_args()
    if args.repeat < 1 or args.cpu_hogs < 0:
        ap.error("--repeat must be at least 1 and --cpu-hogs at least 0")
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        ap.error(f"unknown scenarios {unknown}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    command = invocation("bench.chaos")
    console.print(f"[bold]$ {command}[/]")

    from tests.fault.fleet import Site

    site = Site.on_local_stack("chaos-")
    load_at_start = os.getloadavg()

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.cpu_hogs)]
    outcomes = []
    try:
        for name in names:
            for seed in range(args.seed, args.seed + args.repeat):
                console.print(f"[bold]{name}[/] (seed {seed}) ...")
                outcome = run_one(name, site, seed, args.quick)
                outcomes.append((name, outcome))
                console.print(f"  {outcome.row()}" + (f"  [red]{outcome.problems()}[/]" if outcome.problems() else ""))
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()

    from tests.fault.scenarios import Outcome

    headers = [*Outcome.HEADERS, "checks"]
    def checks(o) -> str:
        if o.problems():
            return "FAILED"
        return "ok, but " + o.detail["rss_problem"] if o.detail.get("rss_problem") else "ok"

    rows = [(*o.row(), checks(o)) for _, o in outcomes]
    seeds = f"seed {args.seed}" if args.repeat == 1 else f"seeds {args.seed}-{args.seed + args.repeat - 1}"
    hogged = f", {args.cpu_hogs} CPU hogs" if args.cpu_hogs else ""
    title = f"Fault injection ({'quick' if args.quick else 'full'} loads, tiny random-weight Llama, {seeds}{hogged})"
    print_table(title, headers, rows)
    fuzz = next((o for n, o in outcomes if n == "fuzz"), None)
    code_rows = []
    if fuzz is not None and "codes" in fuzz.detail:
        for kind, counts in fuzz.detail["codes"].items():
            code_rows += [(code, kind, n) for code, n in counts.items()]
        print_table("Fuzz: answers by code", ["code", "answered as", "messages"], code_rows)
    for name, o in outcomes:
        for problem in o.problems():
            console.print(f"[red]{name}: {problem}[/]")

    data = {"command": command, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seed": args.seed, "quick": args.quick,
            "repeat": args.repeat, "cpu_hogs": args.cpu_hogs, "load_average_at_start": load_at_start,
            "runs": [{"scenario": name, **dict(zip(o.HEADERS, o.row(), strict=True)), "errors": o.errors,
                      "problems": o.problems(), "detail": o.detail} for name, o in outcomes]}
    name = "chaos-quick" if args.quick else "chaos"
    if args.repeat > 1 or args.cpu_hogs:
        name += "-repeat"
    path = write_json(f"{name}.json", data)
    console.print(f"wrote {path}")
    if set(names) == set(SCENARIOS) and args.repeat == 1 and not args.cpu_hogs:
        sections = ["## Fault injection (issue: reliability figures)",
                    f"Measured {data['date']} on this repository's 2-core dev machine. Reproduce with:",
                    f"    {command}", markdown_table(title, headers, rows)]
        if code_rows:
            sections.append(markdown_table("Fuzz: answers by code", ["code", "answered as", "messages"], code_rows))
        if fuzz is not None and "baseline_kb" in fuzz.detail:
            d = fuzz.detail
            sections.append(
                f"Fuzz worker RSS, read when the worker is quiet: {d['baseline_kb']:,} kB after the warm-up, then "
                f"after each round {', '.join(f'{kb:,}' for kb in d['rss_after_round_kb'])} kB, "
                f"{d['rss_growth']:+.1%} (bound: +5%); highest sample while serving {d['rss_peak_kb']:,} kB.")
        sections.append("See docs/reliability.md for what each scenario does and the test that keeps it true.")
        update_docs_section("chaos", "\n\n".join(sections), RELIABILITY)


if __name__ == "__main__":
    main()
