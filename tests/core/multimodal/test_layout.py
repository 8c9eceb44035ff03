"""Images are front-end work: the engine core (scheduler, runner, models, its process) imports no image
library, no renderer or tokenizer module and nothing of ``quire.core.multimodal``."""

import ast
import subprocess
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parents[3] / "packages" / "core" / "src" / "quire" / "core"
# The front end: the only modules that may use quire.core.multimodal (or an image library).
FRONT_END = {"renderer.py", "engine/front_end.py", "engine/input_processor.py", "testing/multimodal_checkpoints.py"}
FORBIDDEN = ("PIL", "tokenizers", "quire.core.multimodal", "quire.core.renderer", "quire.core.tokenizer")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_only_the_front_end_imports_the_multimodal_package_or_pil():
    offenders = []
    for path in CORE.rglob("*.py"):
        relative = path.relative_to(CORE).as_posix()
        if relative.startswith("multimodal/") or relative in FRONT_END:
            continue
        bad = {name for name in imported_modules(path) if name.split(".")[0] == "PIL"
               or name.startswith("quire.core.multimodal")}
        if bad:
            offenders.append((relative, sorted(bad)))
    assert not offenders


def test_the_engine_core_loads_no_image_library_and_no_tokenizer_module():
    code = (
        "import sys, importlib\n"
        "import quire.core.engine.core, quire.core.engine.core_proc, quire.core.worker.model_runner\n"
        "from quire.core.models.registry import _ENTRIES\n"
        "for entry in _ENTRIES.values():\n"
        "    entry.model_class()\n"
        f"loaded = [name for name in {FORBIDDEN!r} if name in sys.modules]\n"
        "assert not loaded, loaded\n"
        "assert 'torch' in sys.modules\n"  # the imports above did load the engine core
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
