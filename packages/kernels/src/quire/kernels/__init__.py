"""Quire's compute kernels.

Each op lives in its own module (``norm``, ``rotary``, ``activation``, ``kv_cache``, ``attention``,
``linear``, ``quant``, ``sampling``, ``decode_stack``, ``moe``, ``pooling``) and takes plain tensors. Every public
function with a fast path has a PyTorch ``*_reference`` twin, the oracle that path is tested against: the C++ CPU
kernels (``cpu_extension``; built with ``python -m quire.kernels build``) and, on NVIDIA GPUs, the Triton kernels
(``triton_ops``). This file imports nothing so that ``import quire.kernels`` stays cheap.
"""
