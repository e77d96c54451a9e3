"""Benchmarks: scripts that print a table and write it to bench/results/."""
