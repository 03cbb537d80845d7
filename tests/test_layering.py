"""The arrows only run down: serve/ and train/ -> common/ -> kernels/.

Every module is parsed, function-local imports included (a lazy import is still a dependency),
and each package may import only the packages below it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "kernels", "train", "serve")
ALLOWED = {  # package -> the Baton packages it may import
    "kernels": set(),
    "common": {"kernels"},
    "train": {"common", "kernels"},
    "serve": {"common", "kernels"},
}


def baton_imports(path: Path) -> list[tuple[int, str]]:
    """(line, baton subpackage) for every import in the file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "baton"]
        for name in names:
            parts = name.split(".")
            if parts[0] == "baton" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return sorted(found)


def violations() -> list[str]:
    bad = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, target in baton_imports(path):
                if target != package and target not in ALLOWED[package]:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports baton.{target}")
    return bad


def test_imports_only_run_down():
    bad = violations()
    assert not bad, "imports that run up or sideways:\n" + "\n".join(bad)


def test_the_checker_sees_function_local_and_from_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os\n\ndef f():\n    from baton.serve.llm import LLM\n    import baton.train.data\n"
        "from baton import kernels\n"
    )
    assert baton_imports(probe) == [(4, "serve"), (5, "train"), (6, "kernels")]
