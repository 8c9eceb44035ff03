"""Re-run this folder's tests in a fresh interpreter in which importing torch fails."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_scheduler_and_kv_cache_tests_pass_without_torch():
    env = {**os.environ, "QUIRE_FORBID_TORCH": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE),
         "-k", "not test_scheduler_and_kv_cache_tests_pass_without_torch"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout and "skipped" not in result.stdout


def test_the_blocker_really_blocks_torch(tmp_path):
    env = {**os.environ, "QUIRE_FORBID_TORCH": "1"}
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text("def test_probe():\n    import torch  # noqa: F401\n")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0 and "must not be imported" in result.stdout
