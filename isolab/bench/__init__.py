"""Owns the benchmarks: the engine-level workload and the HTTP client bench (http_bench)."""
