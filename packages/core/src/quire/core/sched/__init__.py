"""Scheduling and KV-block bookkeeping. Pure Python: nothing under this package imports torch."""
