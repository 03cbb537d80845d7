"""Test-session environment, set before anything imports torch, triton or the hub clients."""

import os

# Triton kernels can only run under the interpreter here (no GPU); the variable must be set
# before any @triton.jit decorator runs, i.e. before baton.kernels is imported anywhere.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Nothing may reach a model or dataset hub: fail fast instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite runs servers, ranks and the test process side by side on few cores, where OpenMP
# threads spinning at barriers stall each other by 10x and more (benchmarks/serve_threads.py):
# sleep instead. Speed only - no result depends on it; tests/serve/test_openmp.py clears it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

from .system import MARKER, require, summary


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}(*names): needs these system packages (tests/system.py)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """@needs(...) (tests/system.py) is checked before the test's fixtures: none is built for nothing."""
    for mark in item.iter_markers(MARKER):
        require(*mark.args)


def pytest_terminal_summary(terminalreporter) -> None:
    """What a user could install to run the tests skipped for missing system packages."""
    for line in summary(terminalreporter.stats.get("skipped", [])):
        terminalreporter.write_line(line)
