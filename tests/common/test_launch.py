"""baton.common.launch: the ranks-per-node a launch reports (it sizes each rank's share of a node's
memory and picks its device), and the serving command's wording in a refusal."""

from __future__ import annotations

import pytest

from baton.common.errors import UserError
from baton.common.launch import read_launch, tasks_on_node

SRUN = {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "9", "SLURM_STEP_NODELIST": "n[1-3]"}


def test_tasks_per_node_lists():
    assert [tasks_on_node("2(x3),1", n) for n in range(4)] == [2, 2, 2, 1]
    assert tasks_on_node("4", 0) == 4
    with pytest.raises(UserError, match="SLURM_NODEID=2 is not a node"):
        tasks_on_node("2(x2)", 2)
    with pytest.raises(UserError, match="cannot read"):
        tasks_on_node("2x", 0)


def test_ranks_on_this_node():
    srun = {**SRUN, "SLURM_STEP_NUM_TASKS": "7", "SLURM_PROCID": "6", "SLURM_LOCALID": "0"}
    last = read_launch({**srun, "SLURM_NODEID": "3", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1"})
    assert (last.rank, last.world_size, last.local_rank, last.local_world_size) == (6, 7, 0, 1)
    assert last.env["MASTER_ADDR"] == "n1"
    assert read_launch(srun).local_world_size == 7  # no per-node list: assume one node
    torchrun = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert read_launch(torchrun).local_world_size == 4
    assert read_launch({"RANK": "1", "WORLD_SIZE": "2"}).local_world_size == 2  # by hand: one node
    assert read_launch({}).local_world_size == 1


def test_refusals_name_the_command():
    with pytest.raises(UserError, match=r"`srun baton serve \.\.\.` or a launcher \(launchers/serve\.sbatch\)"):
        read_launch({"SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, command="serve")
    torchruns = {**SRUN, "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "RANK": "0", "WORLD_SIZE": "2"}
    with pytest.raises(UserError, match="each would load and serve the model alone"):
        read_launch({**torchruns, "LOCAL_WORLD_SIZE": "2"}, command="serve")
