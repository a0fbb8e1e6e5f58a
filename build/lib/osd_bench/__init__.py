"""Benchmarks: speed (engine), stream replay (online learning), serving load. Results -> JSON + BENCHMARKS.md."""
