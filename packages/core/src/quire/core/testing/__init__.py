"""Helpers for tests and benchmarks: tiny, deterministic checkpoints built locally (nothing downloaded)."""
