"""What some tests need that pip cannot install (Debian packages, root), in one table: REQUIREMENTS.

A test states its needs and never checks on its own: `@needs("libaio")` (a marker, evaluated by
tests/conftest.py before the test's fixtures are set up) or `require("libaio")` inside a test or
fixture. Where one is missing the test is skipped, naming what is missing and the exact install
line, and a plain run ends with one line per missing requirement (tests/conftest.py's terminal
summary: what a user could install to run them). With BATON_REQUIRE_SYSTEM=1, which .ci/run sets
(CI installs them all, as root), the skip is a failure instead: a skip that CI could also take
would let CI prove nothing. Something new that pip cannot install is one more row of REQUIREMENTS
(and, if CI lacks it, a package in .ci/run).

To simulate an absence, point a check at a name that does not exist: BATON_LIBAIO_NAME is the
library the libaio check looks up ("aio": libaio.so and libaio.h), CXX the compiler the C++ check
looks for (as torch's extension builder reads it); tests/test_system_requirements.py does so.
"""

from __future__ import annotations

import ctypes.util
import functools
import os
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

STRICT = "BATON_REQUIRE_SYSTEM"  # set (to anything but 0) by .ci/run: missing means failed, not skipped
MARKER = "system"  # @needs(...) is pytest.mark.system(...)
_TAG = re.compile(r"missing system requirement \[([^\]]+)\]")  # how the summary finds them in skip reasons


@dataclass(frozen=True)
class Requirement:
    name: str
    unlocks: str  # the tests it lets run, as the summary names them
    install: str  # the exact command that provides it
    missing: Callable[[], str | None]  # None where it is there, else what is missing


def _tools(*names: str) -> str | None:
    absent = [n for n in names if shutil.which(n) is None]
    return f"not on PATH: {', '.join(absent)}" if absent else None


def _root() -> str | None:
    return None if os.geteuid() == 0 else "not running as root"


def _libaio() -> str | None:
    """DeepSpeed's async_io op links libaio and includes its header: both packages' halves."""
    name = os.environ.get("BATON_LIBAIO_NAME", "aio")
    if ctypes.util.find_library(name) is None:
        return f"no lib{name} shared library"
    if not any(Path(d, f"lib{name}.h").is_file() for d in ("/usr/include", "/usr/local/include")):
        return f"no lib{name}.h header"
    return None


def _cxx() -> str | None:
    """The compiler torch's extension builder runs (kernels/cpu_extension.py, DeepSpeed's ops)."""
    cxx = os.environ.get("CXX", "c++")
    return None if shutil.which(cxx) else f"no C++ compiler {cxx!r} ($CXX, else c++)"


def _netns() -> str | None:
    """tests/netns.py's tools and root, then a namespace actually made: a container may refuse it."""
    if why := _tools("ip", "unshare", "nsenter") or _root():
        return why
    probe = f"batonprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True, timeout=30)
    return None


REQUIREMENTS = {
    r.name: r
    for r in (
        Requirement("libaio", "NVMe offload tests", "sudo apt-get install -y libaio-dev", _libaio),
        Requirement("c++", "C++ CPU kernel tests", "sudo apt-get install -y g++", _cxx),
        Requirement(
            "slurm",
            "SLURM cluster tests",
            "sudo apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge, and run as root",
            lambda: _tools("slurmctld", "slurmd", "munged", "sbatch", "scontrol") or _root(),
        ),
        Requirement(
            "slurm-client", "sbatch dry-run tests", "sudo apt-get install -y slurm-client", lambda: _tools("scontrol")
        ),
        Requirement(
            "netns",
            "two-node tests",
            "sudo apt-get install -y iproute2 util-linux, and run as root",
            _netns,
        ),
    )
}


@functools.cache
def missing(name: str) -> str | None:
    """What is missing of requirement `name` (None: nothing); checked once per process."""
    return REQUIREMENTS[name].missing()


def require(*names: str) -> None:
    """Skip the calling test (fail it under BATON_REQUIRE_SYSTEM=1) unless all of `names` are here."""
    reasons = [
        f"missing system requirement [{n}] for {REQUIREMENTS[n].unlocks} ({why}); install: {REQUIREMENTS[n].install}"
        for n in names
        if (why := missing(n))
    ]
    if not reasons:
        return
    if os.environ.get(STRICT, "0") != "0":
        pytest.fail(f"{STRICT}=1, so nothing may skip for a system package: " + "; ".join(reasons), pytrace=False)
    pytest.skip("; ".join(reasons))


def needs(*names: str) -> pytest.MarkDecorator:
    """The marker form of require(), for a test, a class or a module's pytestmark."""
    unknown = set(names) - REQUIREMENTS.keys()
    assert not unknown, f"not in tests/system.py's REQUIREMENTS: {unknown}"
    return getattr(pytest.mark, MARKER)(*names)


def summary(skipped: Iterable[pytest.TestReport]) -> list[str]:
    """One line per requirement that skipped tests: what they are, how many, the install line."""
    counts: Counter[str] = Counter()
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        counts.update(set(_TAG.findall(reason)))
    return [
        f"Skipped for missing system packages: {r.name} ({r.unlocks}, {counts[r.name]} "
        f"test{'s' if counts[r.name] != 1 else ''}): {r.install}"
        for r in REQUIREMENTS.values()
        if counts[r.name]
    ]
