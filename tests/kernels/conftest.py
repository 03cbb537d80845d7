"""Kernel tests run the Triton kernels under the interpreter on CPU tensors.

TRITON_INTERPRET must be set before baton.kernels is imported (@triton.jit reads it at decoration);
the root conftest sets it for the session, this one too in case it runs first. The compile checks
(test_compile.py) need the opposite, so they run in a subprocess started as soon as collection ends
and their tests are moved to the end of the session: the compiler overlaps the interpreter tests.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from baton.kernels import _utils, flash_attention  # noqa: E402

if not isinstance(flash_attention._flash_fwd_kernel, InterpretedFunction):
    pytest.exit(
        "baton.kernels was imported before TRITON_INTERPRET=1 was set; set it in the environment "
        "or in the root tests/conftest.py",
        returncode=2,
    )

COMPILE_SCRIPT = Path(__file__).with_name("compile_all.py")
COMPILE_TESTS = Path(__file__).with_name("test_compile.py")  # this directory's (tests/train has its own)
_COMPILE_PROC = pytest.StashKey[subprocess.Popen]()


@pytest.fixture(autouse=True)
def _poison_and_seed(monkeypatch):
    """NaN-filled outputs/scratch in every kernel call (catches unwritten elements); fixed seed."""
    monkeypatch.setattr(_utils, "POISON", True)
    torch.manual_seed(0)


def pytest_collection_modifyitems(session, config, items):
    """Compile checks last, so their background subprocess has the whole session to finish."""
    items.sort(key=lambda item: item.path == COMPILE_TESTS)  # stable: other order kept


def pytest_collection_finish(session):
    names = sorted({item.callspec.params["case"] for item in session.items if item.path == COMPILE_TESTS})
    if names:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        session.config.stash[_COMPILE_PROC] = subprocess.Popen(
            [sys.executable, str(COMPILE_SCRIPT), *names],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


def pytest_unconfigure(config):
    proc = config.stash.get(_COMPILE_PROC, None)
    if proc is not None and proc.poll() is None:  # session ended early (-x, Ctrl-C)
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="session")
def compile_results(request) -> dict:
    """{case: {target: "ok" | error}} from the background compile subprocess."""
    proc = request.config.stash[_COMPILE_PROC]
    out, err = proc.communicate(timeout=800)
    assert proc.returncode == 0, f"compile subprocess failed:\n{err[-5000:]}"
    return json.loads(out.strip().splitlines()[-1])
