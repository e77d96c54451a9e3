"""Benchmarks: scripts that print a table and write it to bench/results/.

Product benchmarks a user runs sit here (`python -m bench.throughput`, `bench.kafka_e2e`, ...); kernel
micro-benchmarks sit in bench/kernels/. docs/BENCHMARKS.md gives the headline numbers, docs/perf/ the details.
"""
