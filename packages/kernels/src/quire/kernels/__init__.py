"""Quire's compute kernels.

Each op lives in its own module (``norm``, ``rotary``, ``activation``, ``kv_cache``, ``attention``) and
takes plain tensors. The PyTorch implementations here are the CPU path and the reference that the
Triton kernels are tested against. This file imports nothing so that ``import quire.kernels`` stays cheap.
"""
