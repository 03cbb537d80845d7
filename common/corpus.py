"""The embedded default corpus: the Python standard library's own docstrings.

Baton needs English text to train on that is present on every machine with Python, with
nothing to download. This corpus is the module, class and function docstrings of the .py
files in the running interpreter's standard library (`sysconfig.get_paths()["stdlib"]`),
gathered with `ast` in sorted file order, skipping test packages, idlelib, site-packages and
any file that does not parse. Docstrings are dedented and separated by a blank line. It is
deterministic for a given Python version (about 1.7 MB on CPython 3.11) and is written once
to `<cache root>/corpus/python-stdlib-docstrings-<version>.txt`, the cache root being
`$BATON_CACHE` or `~/.cache/baton`.
"""

from __future__ import annotations

import ast
import os
import platform
import sysconfig
import tempfile
import tokenize
import warnings
from collections.abc import Iterator
from pathlib import Path

DEFAULT_MAX_BYTES = 4_000_000
SKIPPED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def cache_root() -> Path:
    """Where Baton keeps caches: `$BATON_CACHE`, else `~/.cache/baton`."""
    return Path(os.environ.get("BATON_CACHE") or Path.home() / ".cache" / "baton")


def iter_docstrings(stdlib_dir: str | os.PathLike | None = None) -> Iterator[str]:
    """Yield the dedented docstrings of the .py files under `stdlib_dir` (default: this
    interpreter's standard library) in sorted path order, each file's in source order."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)  # prunes the walk
        for name in sorted(f for f in filenames if f.endswith(".py")):
            tree = _parse(Path(dirpath) / name)
            if tree is None:
                continue
            nodes = sorted(
                (n for n in ast.walk(tree) if isinstance(n, _DOCUMENTED)),
                key=lambda n: getattr(n, "lineno", 0),
            )
            for node in nodes:
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    yield doc


def _parse(path: Path) -> ast.Module | None:
    try:
        with warnings.catch_warnings():  # e.g. SyntaxWarning for odd escapes in old modules
            warnings.simplefilter("ignore")
            with tokenize.open(path) as f:  # honours the file's coding cookie
                return ast.parse(f.read(), filename=str(path))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None


def build_corpus(stdlib_dir: str | os.PathLike | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The corpus as UTF-8: whole docstrings, blank-line separated, at most `max_bytes`."""
    parts: list[bytes] = []
    size = 0
    for doc in iter_docstrings(stdlib_dir):
        data = doc.encode("utf-8", errors="replace") + b"\n\n"  # lone surrogates become "?"
        if size + len(data) > max_bytes:
            break
        parts.append(data)
        size += len(data)
    return b"".join(parts)


def default_corpus_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the default corpus file under `cache_dir` (a cache root, default
    `cache_root()`), building it on first use. Written atomically, so concurrent
    first uses never see a partial file."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    path = root / "corpus" / f"python-stdlib-docstrings-{platform.python_version()}.txt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(build_corpus())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    return path


def default_corpus_text(cache_dir: str | os.PathLike | None = None) -> str:
    return default_corpus_path(cache_dir).read_text(encoding="utf-8")
