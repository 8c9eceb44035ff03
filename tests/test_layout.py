"""The monorepo's shape: one PEP 420 namespace, and dependency edges that point one way."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"kernels": "kernels", "core": "core", "offline": "offline",
            "openai-server": "openai_server", "cli": "cli"}
# What each package may import from the quire namespace (besides itself).
ALLOWED = {
    "kernels": set(),
    "core": {"kernels"},
    "offline": {"core"},
    "openai_server": {"core"},
    "cli": {"core", "offline", "openai_server"},
}


def quire_imports(source_dir: Path) -> set[str]:
    found = set()
    for path in source_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value] if node.value.startswith("quire.") else []  # lazy imports by name
            found |= {n.split(".")[1] for n in names if n.startswith("quire.") and n.count(".") >= 1}
    return found


def test_quire_is_a_namespace_package():
    import quire

    assert quire.__file__ is None
    assert not list(ROOT.glob("packages/*/src/quire/__init__.py"))
    assert {Path(p).parent.parent.name for p in quire.__path__} == set(PACKAGES)


@pytest.mark.parametrize("folder,name", PACKAGES.items())
def test_dependency_edges_point_one_way(folder, name):
    imported = quire_imports(ROOT / "packages" / folder / "src" / "quire" / name) - {name}
    assert imported <= ALLOWED[name], f"quire.{name} imports {sorted(imported - ALLOWED[name])}"


def test_package_imports_stay_light():
    code = ("import sys, quire.core, quire.kernels, quire.offline, quire.openai_server, quire.cli; "
            "from quire.core import SamplingParams, AsyncLLM, LLMEngine, EngineClient, SyncEngineClient; "
            "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
