"""How the CPU engine's OpenMP threads wait at the end of a parallel region: spin or sleep.

A decode step is hundreds of small parallel regions. libgomp (torch's OpenMP) spins at every
barrier by default, which is the fastest choice on cores the engine has to itself. Beside other
busy processes it is the slowest by far: a thread whose partner was descheduled spins through its
own time slice, region after region. benchmarks/serve_threads.py, 2 cores, 25M Llama, decode
tokens/s at batch 1 / 16: alone, spin 191 / 1231 and sleep (OMP_WAIT_POLICY=PASSIVE) 132 / 995;
on a busy machine plus one competing process, spin 2 / 21 and sleep 64 / 664 (docs/benchmarks.md).

So "auto" (the default) sleeps when the machine is already busy as serving starts (1-minute load
average at or above the core count) and otherwise leaves libgomp spinning. libgomp reads its
environment once, when torch loads it: the choice is made at `import baton.serve` (and again by
`--omp-wait-policy`, before the engine imports torch); after torch is loaded it can no longer
change, and an OMP_WAIT_POLICY or GOMP_SPINCOUNT the user set is always left alone.
"""

from __future__ import annotations

import os
import sys

POLICIES = ("auto", "spin", "passive")
ENV = "BATON_OMP_WAIT_POLICY"  # the default for --omp-wait-policy (auto)

_ours = False  # whether OMP_WAIT_POLICY in the environment was set here (and may be changed again)
decision = "not made"  # what configure() chose, in words, for the serving log


def choose(policy: str, load: float, cores: int) -> str:
    """ "spin" or "passive" for a requested policy, given the 1-minute load average and core count."""
    if policy not in POLICIES:
        raise ValueError(f"OpenMP wait policy must be one of {POLICIES}, got {policy!r}")
    if policy != "auto":
        return policy
    return "passive" if load >= cores else "spin"


def configure(policy: str | None = None) -> str:
    """Set OMP_WAIT_POLICY for `policy` (default $BATON_OMP_WAIT_POLICY, else auto) if it can still
    take effect; return (and keep in `decision`) what was done, in words."""
    global _ours, decision
    policy = policy or os.environ.get(ENV) or "auto"
    if policy not in POLICIES:  # a typo in the environment is named as such, at import
        raise ValueError(f"{ENV}={policy!r}: the OpenMP wait policy must be one of {', '.join(POLICIES)}")
    user_set = (not _ours and "OMP_WAIT_POLICY" in os.environ) or "GOMP_SPINCOUNT" in os.environ
    if user_set:
        decision = "OpenMP wait policy left as set in the environment"
    elif "torch" in sys.modules:
        if policy != "auto" or decision == "not made":
            decision = f"OpenMP wait policy {policy!r} cannot take effect: torch was loaded before baton.serve"
    else:
        cores, load = os.cpu_count() or 1, os.getloadavg()[0]
        chosen = choose(policy, load, cores)
        if chosen == "passive":
            os.environ["OMP_WAIT_POLICY"], _ours = "PASSIVE", True
        elif _ours:
            del os.environ["OMP_WAIT_POLICY"]
            _ours = False
        why = f" (load {load:.1f} on {cores} cores)" if policy == "auto" else ""
        decision = (
            f"OpenMP threads sleep between parallel regions{why}: the cores are shared"
            if chosen == "passive"
            else f"OpenMP threads spin between parallel regions{why}: the cores are the engine's"
        )
    return decision
