"""Test helpers that ship with the package: the tiny model (also `isolab selftest --tiny`) and the
workload driver (the tests, `isolab selftest`, the lifecycle demo, the doctor)."""
