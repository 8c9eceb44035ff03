"""``quire version`` and ``quire env``."""

from __future__ import annotations

import importlib.metadata
import platform
import sys

PACKAGES = ("quire-cli", "quire-openai-server", "quire-offline", "quire-core", "quire-kernels")


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def print_versions() -> None:
    for name in PACKAGES:
        print(f"{name:22s} {_version(name)}")


def cpu_features() -> list[str]:
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "fma", "sve", "neon")
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith(("flags", "Features"))),
                         [])
    except OSError:
        return []
    return [flag for flag in wanted if flag in flags]


def print_environment() -> None:
    print_versions()
    print(f"{'python':22s} {sys.version.split()[0]} ({platform.platform()})")
    for distribution in ("torch", "transformers", "tokenizers", "triton", "fastapi", "msgspec", "pyzmq"):
        print(f"{distribution:22s} {_version(distribution)}")
    print(f"{'cpu':22s} {platform.machine()}, {_cpu_count()} cores, features: {' '.join(cpu_features()) or '-'}")
    print(f"{'gpu':22s} {_gpus()}")
    print(f"{'cpu kernels':22s} {_cpu_kernels()}")


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def _gpus() -> str:
    try:
        import torch
    except ImportError:
        return "torch not installed"
    if not torch.cuda.is_available():
        return "none"
    return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))


def _cpu_kernels() -> str:
    """The C++ CPU kernels' state (built, not built yet, or why the PyTorch path runs); never builds them."""
    try:
        import torch

        from quire.core.worker.gpu_memory import describe_kernels
    except ImportError as error:
        return f"unavailable ({error})"
    return describe_kernels(torch.device("cpu"))
