import inspect
import json
import platform
import textwrap

import pytest

from baton.common import corpus


@pytest.fixture
def fake_stdlib(tmp_path):
    """A tiny stand-in for the standard library, with every case the walk must handle."""
    root = tmp_path / "stdlib"

    def write(rel, source):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source), encoding="utf-8")

    write(
        "b.py",
        '''\
        """Module b."""

        class C:
            """Class C.

            Detail:
                indented more.
            """

            async def m(self):
                """Method m."""

        def f():
            """Function f."""
        ''',
    )
    write("a.py", '"""Module a."""\n')
    write("pkg/__init__.py", '"""Package pkg."""\n')
    write("broken.py", '"""Never seen."""\ndef (:\n')
    write("nodoc.py", "x = 1\n")
    write("notes.txt", '"""Not Python."""\n')
    for skipped in ("test", "tests", "idlelib", "site-packages"):
        write(f"{skipped}/mod.py", f'"""From {skipped}."""\n')
    return root


def test_docstrings_are_gathered_in_sorted_order_dedented_and_filtered(fake_stdlib):
    assert list(corpus.iter_docstrings(fake_stdlib)) == [
        "Module a.",
        "Module b.",
        "Class C.\n\nDetail:\n    indented more.",
        "Method m.",
        "Function f.",
        "Package pkg.",
    ]


def test_build_corpus_separates_by_blank_lines_and_caps_whole_documents(fake_stdlib):
    full = corpus.build_corpus(fake_stdlib)
    assert full.decode().split("\n\n")[:3] == ["Module a.", "Module b.", "Class C."]
    assert full.endswith(b"Package pkg.\n\n")
    capped = corpus.build_corpus(fake_stdlib, max_bytes=len(b"Module a.\n\nModule b.\n\n") + 3)
    assert capped == b"Module a.\n\nModule b.\n\n"


def test_default_corpus_is_real_stdlib_prose_cached_atomically(tmp_path, monkeypatch):
    path = corpus.default_corpus_path(tmp_path)
    assert path == tmp_path / "corpus" / f"python-stdlib-docstrings-{platform.python_version()}.txt"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind
    text = path.read_text(encoding="utf-8")
    assert 500_000 < len(text.encode()) <= corpus.DEFAULT_MAX_BYTES
    # Independent expectation: the json package's docstring, as the interpreter sees it.
    assert inspect.cleandoc(json.__doc__) in text
    assert inspect.cleandoc(json.JSONDecoder.__doc__) in text
    assert inspect.cleandoc(textwrap.__doc__) in text
    # A second call reuses the file rather than rebuilding it.
    monkeypatch.setattr(corpus, "build_corpus", lambda *a, **k: pytest.fail("rebuilt"))
    mtime = path.stat().st_mtime_ns
    assert corpus.default_corpus_path(tmp_path) == path
    assert path.stat().st_mtime_ns == mtime
    assert corpus.default_corpus_text(tmp_path) == text


def test_default_corpus_is_deterministic():
    assert corpus.build_corpus(max_bytes=300_000) == corpus.build_corpus(max_bytes=300_000)


def test_baton_cache_env_sets_the_cache_root(tmp_path, monkeypatch, fake_stdlib):
    monkeypatch.setenv("BATON_CACHE", str(tmp_path / "root"))
    build = corpus.build_corpus
    monkeypatch.setattr(corpus, "build_corpus", lambda: build(fake_stdlib))
    path = corpus.default_corpus_path()
    assert path.parent == tmp_path / "root" / "corpus"
    assert path.read_text().startswith("Module a.\n\n")
