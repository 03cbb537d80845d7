"""Shared fixtures for the training tests: a tiny recipe, and real `baton train` subprocesses.

Multi-process runs go through torchrun on loopback (free ports), exactly as a user would launch
them; reference runs are made once per session and shared by the tests that compare against them.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from baton.common.corpus import cache_root
from baton.train.backends.readers import read_any
from baton.train.distributed import free_port
from baton.train.universal import UniversalState

SHAKESPEARE = Path(__file__).resolve().parents[3] / "shared" / "data" / "tinyshakespeare.txt"
MULTI_RUN = Path(__file__).with_name("multi_run.py")
STEPS = 20
CKPT_STEP = 10

# A 2-layer, 32-wide model on 32-token blocks: each step takes milliseconds, so a run is mostly
# process start-up. Global batch 8 = 4 micro x accum, whatever the world size.
TINY = {
    "model": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    },
    "data": {"seq_len": 32, "val_fraction": 0.05},
    "tokenizer": {"kind": "char"},
    "optim": {"lr": 1.0e-2, "min_lr": 1.0e-3, "warmup_steps": 2},
    "micro_batch_size": 4,
    "global_batch_size": 8,
    "max_steps": STEPS,
    "eval_interval": 10,
    "eval_batches": 2,
    "log_interval": 1,
    "checkpoint": {"interval": CKPT_STEP, "keep_last": 2},
    "logging": {"progress": False, "mfu": False, "plot": False, "tensorboard": False},
}

DS = ["backend=deepspeed"]
# name -> (number of processes, overrides). Recomputation is switched on in some modes: it must
# not change a single number, so the same references hold, and ZeRO-3 + recompute is exercised.
MODES: dict[str, tuple[int, list[str]]] = {
    "torch-1": (1, []),
    "ddp-2": (2, ["recompute.mode=full"]),
    **{f"z{s}-1": (1, [*DS, f"deepspeed.stage={s}"]) for s in range(4)},
    "z0-2": (2, [*DS, "deepspeed.stage=0"]),
    "z1-2": (2, [*DS, "deepspeed.stage=1"]),
    "z2-2": (2, [*DS, "deepspeed.stage=2", "recompute.mode=selective"]),
    "z3-2": (2, [*DS, "deepspeed.stage=3", "recompute.mode=full"]),
    "z2-offload-2": (2, [*DS, "deepspeed.stage=2", "deepspeed.offload_optimizer=cpu", "deepspeed.cpu_adam=false"]),
    "z3-offload-cpuadam-2": (
        2,
        [*DS, "deepspeed.stage=3", "deepspeed.offload_optimizer=cpu", "deepspeed.offload_param=cpu"],
    ),  # DeepSpeedCPUAdam (the default when offloading)
}
# NVMe: DeepSpeed only swaps groups of >= 1 MiB, so a 0.8M-parameter model (4 layers, 128 wide), else
# everything would quietly stay in memory. "{out}" is the run's out_dir.
WIDER = ["model.hidden_size=128", "model.intermediate_size=512", "model.num_hidden_layers=4"]
NVME_MODES: dict[str, tuple[int, list[str]]] = {
    "z3-nvme-2": (
        2,
        [
            *DS,
            "deepspeed.stage=3",
            "deepspeed.offload_optimizer=nvme",
            "deepspeed.offload_param=nvme",
            "deepspeed.nvme_path={out}/swap",
            *WIDER,
        ],
    ),
    "z3-cpu-wider-2": (
        2,
        [*DS, "deepspeed.stage=3", "deepspeed.offload_optimizer=cpu", "deepspeed.offload_param=cpu", *WIDER],
    ),
}


def nvme_ready() -> bool:
    """NVMe offload needs libaio and DeepSpeed's async_io op, a build of 6+ minutes: too long for
    the suite's budget, so the NVMe tests run where it is already built (or BATON_TEST_NVME=1)."""
    if os.environ.get("BATON_TEST_NVME") == "1":
        return True
    from baton.train.backends.deepspeed_ops import MARKER, build_root

    root = build_root(Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cache_root() / "torch_extensions"))
    return ctypes.util.find_library("aio") is not None and (root / "async_io" / MARKER).is_file()


NVME = nvme_ready()
if NVME:
    MODES.update(NVME_MODES)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    if SHAKESPEARE.is_file():
        path.write_text(SHAKESPEARE.read_text()[:60_000])
    else:  # deterministic stand-in with some structure to learn
        words = "the king said unto his daughter that all men must sleep ere morning comes again".split()
        path.write_text(" ".join(words[(i * 7 + i // 3) % len(words)] for i in range(12_000)))
    return path


@pytest.fixture(scope="session")
def recipe(corpus, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("recipe")
    raw = {**TINY, "data": {**TINY["data"], "path": str(corpus), "cache_dir": str(root / "datasets")}}
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def command(nproc: int, args: list[str], script: str = "-m baton.common.cli") -> list[str]:
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
        if nproc > 1
        else [sys.executable]
    )
    return [*launcher, *script.split(), *args]


def environment(nproc: int) -> dict[str, str]:
    # One thread per rank: cores / ranks on this 2-core machine, and for these tiny matmuls more
    # threads only add synchronisation (on a loaded machine they made steps 20x slower).
    threads = max(1, min(1, (os.cpu_count() or 2) // nproc))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": str(threads), "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}


def train_args(recipe: Path, out_dir: Path, overrides: list[str]) -> list[str]:
    return [
        "train",
        "--config",
        str(recipe),
        f"out_dir={out_dir}",
        *(o.replace("{out}", str(out_dir)) for o in overrides),
    ]


CRASHES = ("(SIGSEGV)", "(SIGABRT)")  # a rank killed by the runtime, not a Python error


def run(nproc: int, args: list[str], log: Path, timeout: float = 300, script: str = "-m baton.common.cli") -> None:
    """Run `args` (under torchrun when nproc > 1); raise with the log on failure. A rank that dies of
    SIGSEGV/SIGABRT inside torch/gloo (seen rarely, at process exit after the run had finished:
    "terminate called without an active exception") relaunches the run once from a clean out_dir,
    with a warning and the crash's log kept; a second crash fails the test."""
    for attempt in (1, 2):
        with open(log, "w") as f:
            proc = subprocess.run(
                command(nproc, args, script),
                env={**environment(nproc), "PYTHONFAULTHANDLER": "1"},
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
        if proc.returncode == 0:
            return
        text = log.read_text()
        out_dir = next((a.split("=", 1)[1] for a in args if a.startswith("out_dir=")), None)
        if attempt == 2 or nproc == 1 or out_dir is None or not any(c in text for c in CRASHES):
            raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}):\n{text[-6000:]}")
        log.with_suffix(".crash.log").write_text(text)
        warnings.warn(f"a rank crashed in the runtime ({log.with_suffix('.crash.log')}); relaunching once")
        shutil.rmtree(out_dir, ignore_errors=True)


def run_and_kill(nproc: int, args: list[str], wait_for: Path, log: Path, timeout: float = 300) -> None:
    """Start a run and SIGKILL its whole process group as soon as `wait_for` exists."""
    with open(log, "w") as f:
        proc = subprocess.Popen(command(nproc, args), env=environment(nproc), stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        try:
            while not wait_for.exists():
                if proc.poll() is not None:
                    raise AssertionError(f"run ended ({proc.returncode}) before {wait_for}:\n{log.read_text()[-6000:]}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"timed out waiting for {wait_for}")
                time.sleep(0.02)
        finally:
            kill_tree(proc.pid)
            proc.wait()


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once, like losing the machine. (torchrun
    starts its workers in their own sessions, so killing its process group is not enough.)"""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(tree, timeout=30)


class Runs:
    """Uninterrupted reference runs, one per mode. The first request makes every mode of that
    world size, in one process group (multi_run.py): a tiny run is mostly start-up."""

    def __init__(self, root: Path, recipe: Path):
        self.root, self.recipe = root, recipe
        self.done: set[str] = set()

    def get(self, mode: str) -> Path:
        if mode not in self.done:
            nproc = MODES[mode][0]
            batch = [m for m, (n, _) in MODES.items() if n == nproc and m not in self.done]
            multi_run(nproc, self.recipe, self.root, {m: MODES[m][1] for m in batch}, f"references-{nproc}.log")
            self.done.update(batch)
        return self.root / mode


def multi_run(nproc: int, recipe: Path, root: Path, runs: dict[str, list[str]], log: str) -> None:
    """Train each of `runs` (name -> overrides; out_dir root/name) one after another in one process
    group of `nproc` ranks (multi_run.py), logging to root/log."""
    specs = [
        f"{name}={','.join(o.replace('{out}', str(root / name)) for o in overrides)}"
        for name, overrides in runs.items()
    ]
    assert not any("," in o for overrides in runs.values() for o in overrides), "multi_run.py splits overrides at ','"
    run(nproc, [str(recipe), str(root), *specs], root / log, timeout=600, script=str(MULTI_RUN))


@pytest.fixture(scope="session")
def runs(recipe, tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("runs"), recipe)


def losses(out_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def final_state(out_dir: Path, step: int = STEPS) -> UniversalState:
    ckpt = out_dir / "checkpoints" / f"step_{step:08d}"
    backend = json.loads((ckpt / "trainer_state.json").read_text())["layout"]["backend"]
    return read_any(ckpt, backend)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in a)


PATTERN_TEXT = "".join(f"the cat sat on the mat number {i % 7}. the dog ran to the log.\n" for i in range(400))


def char_model_checkpoint(tmp_path: Path, name: str = "base"):
    """A small random-weight model with a char tokenizer, saved to tmp_path/name, and a corpus file
    of a repetitive pattern. Returns (corpus path, tokenizer, model)."""
    from baton.common.checkpoint import save_model
    from baton.common.config import ModelConfig
    from baton.common.model import build_model
    from baton.common.tokenizer import train_char

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(PATTERN_TEXT)
    tok = train_char(PATTERN_TEXT)
    model = build_model(
        ModelConfig(
            vocab_size=tok.vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=128,
        ),
        seed=0,
    )
    save_model(tmp_path / name, model, tokenizer=tok)
    return corpus, tok, model


# ---------------------------------------------------------------- DeepSpeed's async_io op (NVMe offload)
BUILD_OP = """
import json, sys, time
from deepspeed.accelerator import get_accelerator
from baton.train.backends.deepspeed import prepare_ops
from baton.train.recipe import config_from_dict

builder = get_accelerator().create_op_builder("AsyncIOBuilder")
if builder is None or not builder.is_compatible(verbose=True):  # verbose: the builder says what is missing
    sys.exit("DeepSpeed's async_io op cannot be built on this machine (it needs libaio: apt-get install libaio-dev): "
             + str(getattr(builder, "error_log", None) or "see the builder's warnings above"))
t0 = time.perf_counter()
prepare_ops(config_from_dict(json.loads(sys.argv[1]), sys.argv[2:]))  # as the trainer does: locked, stale lock removed
print(f"async_io op ready in {time.perf_counter() - t0:.1f}s")
"""


@pytest.fixture(scope="session")
def async_io_op() -> Path:
    """Build DeepSpeed's async_io op (NVMe offload) the way every trainer process loads it, once per
    machine: into Baton's own cache (the trainer's default, kept across clones and fresh venvs; a
    TORCH_EXTENSIONS_DIR already set wins), exported before anything builds so the runs share it.
    A machine that cannot build it fails the tests that need it, with the builder's own error."""
    root = Path(os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache_root() / "torch_extensions")))
    nvme = [
        "backend=deepspeed",
        "deepspeed.stage=3",
        "deepspeed.offload_optimizer=nvme",
        "deepspeed.cpu_adam=false",
        f"deepspeed.nvme_path={root}",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", BUILD_OP, json.dumps(TINY), *nvme],
        env=environment(1),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1500,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"building DeepSpeed's async_io op failed ({proc.returncode}):\n{proc.stdout[-8000:]}", pytrace=False
        )
    return root
