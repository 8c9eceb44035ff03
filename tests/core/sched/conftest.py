"""Scheduler and KV-cache tests are pure Python. Under QUIRE_FORBID_TORCH=1 (set by
test_torch_free.py when it re-runs this folder in a subprocess) importing torch fails, and every
test asserts afterwards that torch never entered sys.modules."""

import importlib.abc
import os
import sys

import pytest

FORBID_TORCH = os.environ.get("QUIRE_FORBID_TORCH") == "1"


class _TorchBlocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch must not be imported by the scheduler or KV-cache code")
        return None


if FORBID_TORCH:
    sys.meta_path.insert(0, _TorchBlocker())


@pytest.fixture(autouse=True)
def _assert_torch_absent():
    yield
    if FORBID_TORCH:
        assert "torch" not in sys.modules
