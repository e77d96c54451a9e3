"""Kernel micro-benchmarks: one kernel or one engine step's parts, timed in alternating arms in one process.

Each writes bench/results/kernels/NAME.json and its section of docs/perf/kernels.md.
"""
