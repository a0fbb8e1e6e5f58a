"""Benchmarks: speed (engine), stream replay (online learning), serving load. Results -> JSON under
benchmarks/<topic>/ and printed tables; `osd bench readme` turns the current ones into the README's results."""
