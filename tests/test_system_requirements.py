"""tests/system.py end to end, in a pytest of its own on a generated test file that loads this
suite's hooks (tests/conftest.py): with libaio pointed at a library that does not exist, tests
needing it are skipped with the install line, and the run ends naming the package, how many tests
it would unlock and how to get it; under BATON_REQUIRE_SYSTEM=1 the same tests fail instead. A
requirement that is there (the compiler pointed at this Python) runs its test either way."""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from .system import STRICT, needs

ROOT = Path(__file__).resolve().parents[1]
INSTALL = "sudo apt-get install -y libaio-dev"
TESTS = """
from tests.system import needs, require

@needs("libaio")
def test_marked():
    pass

def test_called():
    require("libaio")

@needs("c++")
def test_present():
    pass
"""


def run_pytest(tmp_path: Path, strict: bool) -> tuple[subprocess.CompletedProcess, dict[str, tuple[str, str]]]:
    """The run, and each test's outcome and message ({name: ("skipped" | "failure" | "error" | "passed", text)})."""
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_configure, pytest_runtest_setup, pytest_terminal_summary  # noqa: F401\n"
    )
    (tmp_path / "test_generated.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if k not in (STRICT, "PYTEST_ADDOPTS")}
    env |= {"PYTHONPATH": str(ROOT), "BATON_LIBAIO_NAME": "baton-no-such-library", "CXX": sys.executable}
    if strict:
        env[STRICT] = "1"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--junitxml=report.xml", str(tmp_path)]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    outcomes = {}
    for case in ET.parse(tmp_path / "report.xml").iter("testcase"):
        result = next((e for e in case if e.tag in ("skipped", "failure", "error")), None)
        outcomes[case.get("name")] = ("passed", "") if result is None else (result.tag, result.get("message", ""))
    return out, outcomes


def test_a_missing_package_skips_naming_its_install_line_and_the_summary_lists_it(tmp_path):
    out, outcomes = run_pytest(tmp_path, strict=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert outcomes["test_present"] == ("passed", "")
    for name in ("test_marked", "test_called"):
        outcome, message = outcomes[name]
        assert outcome == "skipped" and "[libaio]" in message and INSTALL in message, outcomes[name]
        assert "libbaton-no-such-library" in message  # what the check looked for
    summary = f"Skipped for missing system packages: libaio (NVMe offload tests, 2 tests): {INSTALL}"
    assert summary in out.stdout.splitlines(), out.stdout


def test_under_the_ci_variable_a_missing_package_fails_naming_its_install_line(tmp_path):
    out, outcomes = run_pytest(tmp_path, strict=True)
    assert out.returncode == 1, out.stdout + out.stderr
    assert outcomes["test_present"] == ("passed", "")
    # the marker is checked in the test's set-up, so its failure is reported as an error there
    assert outcomes["test_marked"][0] == "error" and outcomes["test_called"][0] == "failure", outcomes
    for name in ("test_marked", "test_called"):
        assert f"{STRICT}=1" in outcomes[name][1] and INSTALL in outcomes[name][1], outcomes[name]
    assert INSTALL in out.stdout and "Skipped for missing system packages" not in out.stdout


def test_an_unknown_requirement_is_a_mistake_not_a_skip():
    with pytest.raises(AssertionError, match="not in tests/system.py"):
        needs("libaoi")
