"""serve/openmp.py: the wait policy it chooses reaches libgomp (read back from libgomp's own
OMP_DISPLAY_ENV report in a fresh process, since libgomp reads its environment once, at load)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from baton.serve.openmp import choose


def spincount(code: str, **env: str) -> int:
    """GOMP_SPINCOUNT as libgomp reports it after `code` runs and torch loads (0 = sleep at once)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport torch"],
        env={**clean, "OMP_DISPLAY_ENV": "VERBOSE", **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return int(re.search(r"GOMP_SPINCOUNT = '(\d+)'", out.stderr).group(1))


def test_auto_sleeps_only_when_the_machine_is_already_busy():
    assert choose("auto", load=2.0, cores=2) == "passive" and choose("auto", load=1.9, cores=2) == "spin"
    assert choose("spin", load=50, cores=2) == "spin" and choose("passive", load=0, cores=2) == "passive"
    with pytest.raises(ValueError, match="one of"):
        choose("busy", load=0, cores=2)


def test_the_choice_reaches_libgomp_and_a_users_setting_is_left_alone():
    default = spincount("")
    assert default > 0  # libgomp spins by default (300000)
    assert spincount("import baton.serve", BATON_OMP_WAIT_POLICY="passive") == 0
    assert spincount("import baton.serve", BATON_OMP_WAIT_POLICY="spin") == default
    assert spincount("import baton.serve", BATON_OMP_WAIT_POLICY="passive", GOMP_SPINCOUNT="1234") == 1234
    # --omp-wait-policy (configure again, before torch loads) overrides the import-time choice both ways
    reconfigure = "from baton.serve import openmp\nopenmp.configure({!r})"
    assert spincount(reconfigure.format("spin"), BATON_OMP_WAIT_POLICY="passive") == default
    assert spincount(reconfigure.format("passive"), BATON_OMP_WAIT_POLICY="spin") == 0
    # too late once torch is loaded: said, not pretended
    bad = subprocess.run(
        [sys.executable, "-c", "import baton.serve"],
        env={**os.environ, "BATON_OMP_WAIT_POLICY": "fast"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode != 0 and "BATON_OMP_WAIT_POLICY='fast'" in bad.stderr
    late = "import torch\nfrom baton.serve import openmp\nassert 'cannot take effect' in openmp.configure('passive')"
    assert spincount(late) == default
