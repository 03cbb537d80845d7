"""The checkout's kernels/ directory is baton.kernels, but a Python started in the checkout's root
sees it as a top-level `kernels` too: the name of the PyPI package transformers (>= 5.25) imports
at `import transformers.modeling_utils`. kernels/__init__.py hands that name to the real package."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_in_root(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_top_level_kernels_from_the_checkout_root_is_not_ours():
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        done = run_in_root("import kernels, transformers.modeling_utils; print(kernels.__file__)")
        assert done.returncode == 0, done.stderr  # what transformers (no `kernels` version) ignores
        return
    done = run_in_root("import kernels, transformers.modeling_utils; print(kernels.__file__)")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).parent != ROOT / "kernels"


def test_baton_kernels_is_still_ours_beside_it():
    done = run_in_root("import kernels, baton.kernels as k; print(k.__file__, k.swiglu.__module__)")
    assert done.returncode == 0, done.stderr
    path, module = done.stdout.split()
    assert Path(path) == ROOT / "kernels" / "__init__.py" and module == "baton.kernels.activation"
