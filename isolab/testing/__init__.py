"""Test helpers that ship with the package (the tiny model is also used by `isolab selftest --tiny`)."""
