"""Benchmarks, one module per command: ``collectives`` (nccl-tests-style all-reduce table).

Each benchmark checks correctness as it measures, prints fixed-width tables with units and a
``#`` before every non-data line, and writes its numbers as JSON (rank 0, atomically);
docs/PERFORMANCE.md defines every figure.
"""
