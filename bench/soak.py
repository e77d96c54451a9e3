"""A soak: a steady chat request rate for 20 minutes; throughput, p99 latency and worker RSS per minute.

    .venv/bin/python -m bench.soak                  # 20 minutes, 4 req/s, 2 workers
    .venv/bin/python -m bench.soak --minutes 3      # a shorter run
    .venv/bin/python -m bench.soak --minutes 12 --kv-cache-bytes 16MiB   # a small KV pool (its own section)

Real `infinilm worker` processes on the shared local stack (tests.fault.soak_run),
a tiny random-weight Llama so the machine is not the bottleneck; latency is from
sending a request to reading its committed result (read_committed). At the end,
a read_committed audit of the results topic counts lost and duplicated results.
"""

from __future__ import annotations

import argparse
import os
import time

from bench.report import (
    REPO,
    console,
    invocation,
    markdown_table,
    print_table,
    update_docs_section,
    write_json,
)

RELIABILITY = REPO / "docs" / "reliability.md"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-bytes", default=None, metavar="SIZE",
                    help="the workers' KV pool (memory.kv_cache_bytes, e.g. 16MiB; the harness default is 256MiB). "
                         "The prefix cache's bookkeeping grows until every block of the pool is cached, so a small "
                         "pool shows RSS after that warm-up within a short run; written to its own JSON and section")
    args = ap.parse_args()
    if args.kv_cache_bytes:
        from worker.config import parse_bytes

        try:
            if parse_bytes(args.kv_cache_bytes) <= 0:
                raise ValueError(f"expected a positive size, got {args.kv_cache_bytes!r}")
        except ValueError as exc:
            ap.error(f"--kv-cache-bytes: {exc}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    command = invocation("bench.soak")
    console.print(f"[bold]$ {command}[/]")

    from tests.fault.fleet import Site
    from tests.fault.soak_run import SoakReport, soak

    site = Site.on_local_stack("soak-")
    load_at_start = os.getloadavg()
    sections = {"memory": {"kv_cache_bytes": args.kv_cache_bytes}} if args.kv_cache_bytes else None
    report = soak(site, minutes=args.minutes, rate=args.rate, workers=args.workers, seed=args.seed, sections=sections)
    o = report.outcome

    pool = f", {args.kv_cache_bytes} KV pool" if args.kv_cache_bytes else ""
    title = (f"Soak: {args.rate:g} chat req/s for {args.minutes:g} min, {args.workers} workers, "
             f"tiny random-weight Llama{pool}")
    print_table(title, list(SoakReport.HEADERS), report.rows())
    summary = [(o.test, o.load, o.lost, o.duplicated, o.crashed, o.errors, f"{report.rss_growth:+.1%}",
                f"{o.wall_s:.0f}")]
    summary_headers = ["run", "load", "lost", "duplicated", "crashed", "errors", "RSS after min 1", "wall s"]
    print_table("Soak verdict", summary_headers, summary)
    for problem in o.problems():
        console.print(f"[red]{problem}[/]")

    date = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    data = {"command": command, "date": date, "minutes": args.minutes, "rate": args.rate, "workers": args.workers,
            "load_average_at_start": load_at_start, "per_minute": report.minutes, "rss_samples_kb": report.rss,
            "rss_growth_after_minute_1": report.rss_growth, "lost": o.lost, "duplicated": o.duplicated,
            "crashed": o.crashed, "errors": o.errors, "wall_s": o.wall_s, "problems": o.problems(),
            "kv_cache_bytes": args.kv_cache_bytes}
    path = write_json("soak-kv.json" if args.kv_cache_bytes else "soak.json", data)
    console.print(f"wrote {path}")
    update_docs_section("soak_kv" if args.kv_cache_bytes else "soak", "\n\n".join([
        f"### A bench/soak.py run{pool}",
        f"Measured {date} on this repository's 2-core dev machine, shared with other work. Reproduce with:",
        f"    {command}",
        markdown_table(title, list(SoakReport.HEADERS), report.rows()),
        markdown_table("Soak verdict", summary_headers, summary),
        "Latency runs from sending a request to reading its committed result; RSS is the sum over the "
        "workers at each minute's last sample.",
    ]), RELIABILITY)


if __name__ == "__main__":
    main()
