"""The shape of the tree: arrows, circles and file lengths.

Arrows only run down: serve/ and train/ -> common/ -> kernels/. Every module is parsed,
function-local imports included (a lazy import is still a dependency), and each package may import
only the packages below it.

No import circles inside a package (common, kernels, train, serve and their sub-packages). Every
import counts: at module level, inside a function, under `if TYPE_CHECKING:`, relative ones
(`from .x import y`, `from . import x`), `import baton.a.b` and `from baton.a import b` where b is a
submodule (an edge to b, and one to a's `__init__.py`: naming a package runs its `__init__.py`, so a
submodule that imports its own package's name imports its `__init__`). An import of a submodule
does not also count as an import of its parents' `__init__.py`s. A failure names every circle's
files and each import that closes it (file:line).

No source file over 500 lines (MAX_LINES): Python under common/ kernels/ train/ serve/ benchmarks/
tests/, C++ and CUDA under kernels/csrc/. A file may be longer only if one of its first 15 lines
says why, as a comment line that starts with the marker and gives a reason after the colon:
    # longer than 500 lines: <why it is one file>        (Python)
    // longer than 500 lines: <why it is one file>       (C++: e.g. one translation unit, so the
                                                          compiler inlines the micro-kernel)
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "kernels", "train", "serve")
ALLOWED = {  # package -> the Baton packages it may import
    "kernels": set(),
    "common": {"kernels"},
    "train": {"common", "kernels"},
    "serve": {"common", "kernels"},
}
MAX_LINES = 500
HEADER_LINES = 15
LONG_MARKERS = {".py": "# longer than 500 lines:"} | {
    ext: "// longer than 500 lines:" for ext in (".cpp", ".cc", ".h", ".hpp", ".cu", ".cuh")
}
LENGTH_CHECKED = {  # folder -> the file endings whose length is checked there
    **{d: (".py",) for d in (*PACKAGES, "benchmarks", "tests")},
    "kernels/csrc": (".cpp", ".cc", ".h", ".hpp", ".cu", ".cuh"),
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


# ------------------------------------------------------------------------------------- circles
def module_files(root: Path, packages: Mapping[str, str]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under each folder (folder -> its import name);
    a package is named by its `__init__.py`."""
    mods = {}
    for folder, dotted in packages.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = [dotted, *path.relative_to(root / folder).with_suffix("").parts]
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def module_imports(name: str, path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of everything the module `name` imports, at any depth, relative imports
    resolved; `from a import b` gives both a and a.b (the caller keeps the names that are modules)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                if node.level - 1 > len(parts):
                    continue
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return found


def import_graph(mods: Mapping[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {module it imports: first line that does}, only modules of `mods`, no self-edges."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        edges = graph[name] = {}
        for line, target in sorted(module_imports(name, path)):
            if target in mods and target != name:
                edges.setdefault(target, line)
    return graph


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted: the modules of a
    component all reach one another, so any one of them can only be imported after itself."""
    reach = {}
    for start in graph:
        seen, todo = {start}, [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[start] = seen
    found = {frozenset(w for w in reach[v] if v in reach[w]) for v in graph}
    return sorted(sorted(c) for c in found if len(c) > 1)


def circle_report(root: Path, packages: Mapping[str, str]) -> list[str]:
    """One block per circle: its files, then every import between them (file:line -> file)."""
    mods = module_files(root, packages)
    graph = import_graph(mods)
    rel = {name: str(path.relative_to(root)) for name, path in mods.items()}
    out = []
    for circle in circles(graph):
        out.append(f"circle of {len(circle)} files: {', '.join(rel[m] for m in circle)}")
        for m in circle:
            out += [f"    {rel[m]}:{line} imports {rel[t]}" for t, line in graph[m].items() if t in circle]
    return out


def test_no_import_circles_inside_a_package():
    report = circle_report(ROOT, {p: f"baton.{p}" for p in PACKAGES})
    assert not report, "import circles:\n" + "\n".join(report)


# -------------------------------------------------------------------------------------- lengths
def long_files(root: Path, checked: Mapping[str, tuple[str, ...]] = LENGTH_CHECKED) -> list[str]:
    """'path: N lines' for every checked file over MAX_LINES whose header does not say why."""
    bad = []
    paths = {
        p for folder, exts in checked.items() for p in (root / folder).rglob("*") if p.suffix in exts and p.is_file()
    }
    for path in sorted(paths):
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        marker = LONG_MARKERS[path.suffix]
        said_why = any(
            s.startswith(marker) and s[len(marker) :].strip() for s in (line.strip() for line in lines[:HEADER_LINES])
        )
        if len(lines) > MAX_LINES and not said_why:
            bad.append(f"{path.relative_to(root)}: {len(lines)} lines")
    return bad


def test_no_source_file_over_500_lines():
    bad = long_files(ROOT)
    assert not bad, (
        f"files over {MAX_LINES} lines (split them, or say why in a header line "
        f"'{LONG_MARKERS['.py']} <reason>' / '{LONG_MARKERS['.cpp']} <reason>'):\n" + "\n".join(bad)
    )


# ---------------------------------------------------------------------------- the checkers' checks
def test_the_checker_sees_function_local_and_from_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os\n\ndef f():\n    from baton.serve.llm import LLM\n    import baton.train.data\n"
        "from baton import kernels\n"
    )
    assert baton_imports(probe) == [(4, "serve"), (5, "train"), (6, "kernels")]


def _package(root: Path, files: dict[str, str]) -> dict[str, str]:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return {"pkg": "baton.pkg"}


def test_the_circle_checker_finds_lazy_type_checking_relative_and_parent_package_circles(tmp_path):
    packages = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            # through a function-local import of a submodule by `from package import module`
            "pkg/a.py": "def f():\n    from baton.pkg import b\n",
            "pkg/b.py": "import baton.pkg.a as a\n",
            # through an import under TYPE_CHECKING, closed by a relative one
            "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from baton.pkg.d import D\n",
            "pkg/d.py": "from .c import C\n",
            # a submodule importing its own package's name imports its __init__
            "pkg/sub/__init__.py": "from .e import E\n",
            "pkg/sub/e.py": "class E:\n    def f(self):\n        from baton.pkg.sub import helper\n",
            "pkg/sub/f.py": "from ..a import f\n",  # an arrow into a circle, not part of it
        },
    )
    graph = import_graph(module_files(tmp_path, packages))
    assert graph["baton.pkg.a"] == {"baton.pkg": 2, "baton.pkg.b": 2}
    assert graph["baton.pkg.sub.f"] == {"baton.pkg.a": 1}
    assert circles(graph) == [
        ["baton.pkg.a", "baton.pkg.b"],
        ["baton.pkg.c", "baton.pkg.d"],
        ["baton.pkg.sub", "baton.pkg.sub.e"],
    ]
    report = circle_report(tmp_path, packages)
    assert report[:3] == [
        "circle of 2 files: pkg/a.py, pkg/b.py",
        "    pkg/a.py:2 imports pkg/b.py",
        "    pkg/b.py:1 imports pkg/a.py",
    ]
    assert "circle of 2 files: pkg/sub/__init__.py, pkg/sub/e.py" in report


def test_the_circle_checker_passes_a_clean_package(tmp_path):
    packages = _package(
        tmp_path,
        {
            "pkg/__init__.py": "from . import a\nfrom .b import B\n",
            "pkg/a.py": "import os\nfrom baton.other import thing\n",
            "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\nclass B: ...\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/c.py": "def f():\n    from baton.pkg import b\n    from ..a import A\n    import baton.pkg.sub\n",
        },
    )
    assert circles(import_graph(module_files(tmp_path, packages))) == []
    assert circle_report(tmp_path, packages) == []


def test_the_length_checker_wants_a_reason_in_the_header(tmp_path):
    body = "x = 1\n" * MAX_LINES
    _package(
        tmp_path,
        {
            "pkg/fits.py": body,
            "pkg/long.py": body + "x = 2\n",
            "pkg/why.py": '"""Doc."""\n# longer than 500 lines: one table, split it and nothing reads better\n' + body,
            "pkg/no_reason.py": "# longer than 500 lines:\n" + body,
            "pkg/too_late.py": body[: 6 * HEADER_LINES] + "# longer than 500 lines: too far down\n" + body,
            "csrc/long.cpp": "int x;\n" * (MAX_LINES + 1),
            "csrc/why.cpp": "// longer than 500 lines: one translation unit, so the micro-kernel inlines\n" + body,
            "csrc/python_marker.cpp": "# longer than 500 lines: the wrong marker\n" + body,
        },
    )
    assert long_files(tmp_path, {"pkg": (".py",), "csrc": (".cpp",)}) == [
        "csrc/long.cpp: 501 lines",
        "csrc/python_marker.cpp: 501 lines",
        "pkg/long.py: 501 lines",
        "pkg/no_reason.py: 501 lines",
        "pkg/too_late.py: 516 lines",
    ]
