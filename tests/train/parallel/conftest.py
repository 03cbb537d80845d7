"""Fixtures for the parallel-layout tests: harness launches (one torchrun per world size, every
layout of that size in one process group) and the single-process reference they are held to."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from baton.train.distributed import free_port

from .harness import CASES
from .reference import reference_run

HARNESS = Path(__file__).with_name("harness.py")


class RankCrashed(AssertionError):
    """A rank died of SIGSEGV (seen once in a 4-rank gloo run, inside torch): not a wrong number."""


def torchrun(nproc: int, args: list[str], log: Path, timeout: float = 600) -> None:
    """Run `args` under torchrun on loopback, one thread per rank; raise with the log on failure
    (a crashing rank dumps its Python stack into the log: PYTHONFAULTHANDLER)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        *args,
    ]
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        text = log.read_text()
        error = RankCrashed if "(SIGSEGV)" in text else AssertionError
        raise error(f"{' '.join(args)} failed ({proc.returncode}):\n{text[-6000:]}")


class Harness:
    """Launches on first use: world 4 first (its TP=2 x PP=2 run writes the checkpoint that the
    world-2 and world-1 launches resume from)."""

    def __init__(self, root: Path):
        self.root = root
        self.launched: set[int] = set()

    def launch(self, world: int) -> None:
        if world in self.launched:
            return
        if world < 4:
            self.launch(4)
        cases = [n for n, c in CASES.items() if c["world"] == world] + (["ring"] if world > 1 else [])
        log = self.root / f"world{world}.log"
        try:
            torchrun(world, [str(HARNESS), str(self.root), *cases], log)
        except RankCrashed as crash:  # relaunch once from clean outputs; a second crash fails the tests
            warnings.warn(
                f"a rank of the world-{world} harness crashed (SIGSEGV); relaunching once. "
                f"The crash's log: {log.with_suffix('.crash.log')}"
            )
            log.with_suffix(".crash.log").write_text(str(crash))
            for name in cases:
                shutil.rmtree(self.root / (f"ring{world}" if name == "ring" else name), ignore_errors=True)
            torchrun(world, [str(HARNESS), str(self.root), *cases], log)
        self.launched.add(world)

    def result(self, case: str) -> dict:
        """A case's records, merged over ranks: per-step lists from rank 0, whole tensors from
        the ranks holding each pipeline stage."""
        self.launch(CASES[case]["world"])
        recs = [torch.load(p, weights_only=True) for p in sorted((self.root / case).glob("rank*.pt"))]
        out = dict(recs[0])
        steps = len(out["losses"])
        out["grads"], out["weights_before"], out["weights"] = [{} for _ in range(steps)], [{} for _ in range(steps)], {}
        for r in recs:
            for merged, part in zip(out["grads"], r["grads"]):
                merged.update(part)
            for merged, part in zip(out["weights_before"], r["weights_before"]):
                merged.update(part)
            out["weights"].update(r["weights"])
        out["memory_per_rank"] = [r["memory"] for r in recs]
        return out

    def ring(self, world: int) -> list[dict[str, float]]:
        self.launch(world)
        return [torch.load(p, weights_only=True) for p in sorted((self.root / f"ring{world}").glob("rank*.pt"))]


@pytest.fixture(scope="session")
def harness(tmp_path_factory) -> Harness:
    return Harness(tmp_path_factory.mktemp("parallel"))


@pytest.fixture(scope="session")
def reference() -> dict:
    return reference_run()


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest difference over tensors, relative to each reference tensor's largest entry."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in b)
