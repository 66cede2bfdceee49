"""Loading the scripts under benchmarks/ (not a package) as modules for their tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def load_script(path: Path) -> ModuleType:
    """The script at `path` as a module, executed once (its `main` is not run)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script
