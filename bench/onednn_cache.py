"""Memory that oneDNN linears keep per input shape, with and without the engine's row buckets.

    .venv/bin/python -m bench.onednn_cache            # SmolLM2-135M's five weight shapes, rows 9-256
    .venv/bin/python -m bench.onednn_cache --rounds 3

The engine runs fp32 linears of 9-256 rows through oneDNN (engine/models/linear.py).
oneDNN keeps a compiled primitive per (rows, weight shape) for the life of the
process, so a worker that meets a new batch size keeps growing. Each mode runs in
a fresh process: it passes every row count from 9 to 256 through each of
SmolLM2's weight shapes (random weights: only the shapes matter), `--rounds`
times, and reads RSS after each round. "raw" calls oneDNN with the row count as
it comes; "buckets" calls the engine's `linear`, which pads rows to 12 buckets.
A cache that is bounded stops growing after the first round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.report import REPO, invocation, markdown_table, print_table, update_docs_section, write_json

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}

_PROBE = """
import gc, json, re, sys, torch
from engine.models.linear import linear
mode, rounds, shapes = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])


def rss_mib():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\\s+(\\d+) kB", f.read())[1]) / 1024


weights = [torch.randn(o, i) for o, i in shapes.values()]
inputs = {i: torch.randn(256, i) for i in {w.shape[1] for w in weights}}
out = {"start": rss_mib(), "rounds": []}
with torch.no_grad():
    for _ in range(rounds):
        for rows in range(9, 257):
            for w in weights:
                x = inputs[w.shape[1]][:rows]
                if mode == "raw":
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                else:
                    linear(x, w)
        gc.collect()
        out["rounds"].append(rss_mib())
print(json.dumps(out))
"""


def measure(mode: str, rounds: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", _PROBE, mode, str(rounds), json.dumps(SHAPES)],
                          capture_output=True, text=True, cwd=REPO, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="passes over every row count (default 3)")
    args = ap.parse_args()
    data = {"command": invocation("bench.onednn_cache"), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load": os.getloadavg()[0], "shapes": SHAPES, "modes": {}}
    for mode in ("raw", "buckets"):
        data["modes"][mode] = measure(mode, args.rounds)
    write_json("onednn_cache.json", data)
    headers = ["mode", "RSS at start MiB", *[f"after round {i + 1}" for i in range(args.rounds)]]
    rows = [(mode, f"{m['start']:.0f}", *[f"+{r - m['start']:.0f}" for r in m["rounds"]])
            for mode, m in data["modes"].items()]
    print_table("oneDNN primitive memory (RSS growth, MiB)", headers, rows)
    raw, bucketed = data["modes"]["raw"], data["modes"]["buckets"]
    update_docs_section("onednn_cache", "\n\n".join([
        "### oneDNN's per-shape memory, and the row buckets",
        f"Measured {data['date']} (load average {data['load']:.1f}) with `{data['command']}`: every row count from "
        "9 to 256 through SmolLM2-135M's five fp32 weight shapes, once per round, in a fresh process per mode.",
        markdown_table("RSS growth over the process's start (MiB)", headers, rows),
        f"Raw row counts grew the process by {raw['rounds'][-1] - raw['start']:.0f} MiB after {args.rounds} rounds; "
        f"with the engine's buckets it grew by {bucketed['rounds'][0] - bucketed['start']:.0f} MiB in the first round "
        f"and {bucketed['rounds'][-1] - bucketed['rounds'][0]:+.0f} MiB after that.",
    ]), docs=REPO / "docs" / "reliability.md")


if __name__ == "__main__":
    main()
