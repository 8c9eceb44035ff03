"""Tensor parallelism's process group (``group``); imports no torch until a group is made."""
