"""Two nodes for real (tests/netns.py: two network namespaces joined by a veth pair, each with its
own host name and /etc/hosts): `baton train` over both, its losses checked against one process of
the same recipe (fp32, 1e-5 relative).

- torchrun on each node, --nnodes 2, c10d rendezvous at the first node's host name, a
  tensor-parallel job (torch3d tp=2: every layer's all-reduce crosses the veth);
- SLURM: slurmctld and a slurmd on the first node, a slurmd on the second
  (launchers/slurm/local_cluster.sh with CLUSTER_NODES), `sbatch --nodes 2 launchers/train.sbatch` (DDP:
  one torchrun per node, the rendezvous from SLURM's variables) and `launchers/deepspeed.sbatch`
  (ZeRO-2: srun starts the ranks, no pdsh or ssh). Under SLURM gloo finds the veth by the host
  name alone (no GLOO_SOCKET_IFNAME), as on a cluster whose node names resolve.

Needs "netns" and, for SLURM, "slurm" (tests/system.py): skipped where they are missing, naming
the apt line, and failed instead in CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..netns import Node, two_nodes
from ..system import require
from .conftest import kill_tree, losses, train_args
from .parallel.test_slurm import DONE, submit, wait_for
from .parallel.test_slurm import _env as clean_env

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
LAUNCHERS = ROOT / "launchers"
RDZV_PORT = 29400  # each namespace has its own ports: nothing else listens there
TOL = 1e-5


def node_env(node: Node) -> dict[str, str]:
    """A clean launch environment (no launcher or SLURM variables from this process); gloo on the veth."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))
    }
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": node.dev}


def veth_bytes(node: Node) -> int:
    """Bytes sent and received on the node's end of the veth pair: its only way to the other node."""
    stats = [f"/sys/class/net/{node.dev}/statistics/{d}_bytes" for d in ("tx", "rx")]
    out = subprocess.run(["ip", "netns", "exec", node.netns, "cat", *stats], capture_output=True, text=True, timeout=30)
    return sum(int(x) for x in out.stdout.split())


def assert_same_losses(run_dir: Path, reference: Path) -> None:
    got, want = losses(run_dir), losses(reference)
    assert len(got) == len(want) == 20 and want[-1] < want[0] - 0.5
    rel = [abs(a - b) / b for a, b in zip(got, want)]
    assert max(rel) < TOL, rel


@pytest.fixture(scope="module")
def single(runs) -> Path:
    """The recipe on one plain process (the session's torch-1 run): the yardstick for every two-node run."""
    return runs.get("torch-1")


@pytest.fixture(scope="module")
def nodes():
    with two_nodes(("node0", "node1")) as pair:
        yield pair


def test_torchrun_c10d_rendezvous_across_two_nodes(nodes, recipe, single, tmp_path):
    """One torchrun per node meets the other through c10d at node0 (a host name each node
    resolves to node0's veth address); TP=2 splits every layer across the two nodes."""
    logs, procs, before = [tmp_path / f"node{k}.log" for k in range(2)], [], veth_bytes(nodes[0])
    try:
        for node, log in zip(nodes, logs):
            cmd = node.command(
                *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"),
                *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"{nodes[0].hostname}:{RDZV_PORT}"),
                *("--rdzv-id", "two-node", "--max-restarts", "0"),
                *("-m", "baton.common.cli"),
                *train_args(recipe, tmp_path / "run", ["backend=torch3d", "parallel.tp=2"]),
            )
            procs.append(subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=node_env(node)))
        codes = [p.wait(timeout=300) for p in procs]
        assert codes == [0, 0], "\n---\n".join(log.read_text()[-4000:] for log in logs)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
    assert_same_losses(tmp_path / "run", single)
    # 20 steps of TP=2 all-reduces of activations and gradients: megabytes, all over the veth.
    traffic = veth_bytes(nodes[0]) - before
    assert traffic > 1_000_000, traffic
    print(f"two nodes (torchrun c10d, tp=2): {traffic / 1e6:.1f} MB over the veth")


@pytest.fixture(scope="module")
def cluster(nodes, tmp_path_factory):
    """slurmctld + slurmd on node0, slurmd on node1 (munged shared); clients run on node0."""
    require("slurm")  # ("netns", which `nodes` required, has nsenter: in_node.sh enters each node with it)
    state = tmp_path_factory.mktemp("slurm2")
    env = clean_env(CLUSTER_NODES=" ".join(f"{n.hostname}={n.addr}@{n.netns}" for n in nodes))
    script = str(LAUNCHERS / "slurm" / "local_cluster.sh")
    started = subprocess.run([script, "start", str(state)], env=env, capture_output=True, text=True, timeout=120)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield clean_env(SLURM_CONF=str(state / "slurm.conf"))
    finally:
        subprocess.run([script, "stop", str(state)], env=env, timeout=180)


@pytest.mark.parametrize(
    "script, overrides",
    [("train.sbatch", []), ("deepspeed.sbatch", ["backend=deepspeed", "deepspeed.stage=2"])],
    ids=["train.sbatch-ddp", "deepspeed.sbatch-zero2"],
)
def test_sbatch_two_nodes(nodes, cluster, recipe, single, tmp_path, script, overrides):
    """sbatch --nodes 2: train.sbatch runs a torchrun per node that meet by c10d at the first node
    of SLURM_JOB_NODELIST (DDP); deepspeed.sbatch has srun start the ranks (ZeRO-2), each taking
    its rank and master from SLURM's variables. The losses are those of one process."""
    out, log, before = tmp_path / "run", tmp_path / "job.log", veth_bytes(nodes[0])
    where = ("ip", "netns", "exec", nodes[0].netns)
    args = ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", f"--output={log}", str(LAUNCHERS / script)]
    job = submit(cluster, [*args, *train_args(recipe, out, overrides)[1:]], where, BATON_DIR=str(ROOT))
    try:
        state = wait_for(cluster, job, DONE, timeout=420, where=where)
    finally:  # a job left running would outlive the cluster's daemons
        subprocess.run([*where, "scancel", job], env=cluster, capture_output=True, timeout=30)
    text = log.read_text()
    assert state == "COMPLETED", text[-5000:]
    assert "on 2 node(s) x 1 rank(s)" in text, text[-3000:]
    assert_same_losses(out, single)
    traffic = veth_bytes(nodes[0]) - before
    assert traffic > 1_000_000, traffic  # the gradients' all-reduce crossed between the nodes
    print(f"two nodes ({script}): {traffic / 1e6:.1f} MB over the veth")
