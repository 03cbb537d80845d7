"""Eight ranks, three non-trivial dimensions at once (run by torchrun: harness_3d.py OUT).

The harness's model, data and recording (harness.py), at 3-D layouts of 8 ranks in one process
group: TP=2 x PP=2 x DP=2 trains 12 steps and saves a DCP checkpoint at step 6; TP=2 x CP=2 x DP=2
trains 12 steps from scratch (context parallelism as a third dimension); the step-6 checkpoint
then resumes at PP=2 x CP=2 x DP=2 (the tensor-parallel shards become whole, the sequence is
split instead) and at TP=2 x CP=2 x DP=2 (the two pipeline stages become one). test_3d.py holds
them to the single-process reference.
"""

from __future__ import annotations

# name -> the harness's case spec; run in this order (the save comes before its resume).
CASES_3D: dict[str, dict] = {
    "tp2_pp2_dp2": dict(world=8, par=dict(tp=2, pp=2, dp=2), save=True),
    "tp2_cp2_dp2": dict(world=8, par=dict(tp=2, cp=2, dp=2)),
    "resume_pp2_cp2_dp2": dict(world=8, par=dict(pp=2, cp=2, dp=2), resume="tp2_pp2_dp2"),
    "resume_tp2_cp2_dp2": dict(world=8, par=dict(tp=2, cp=2, dp=2), resume="tp2_pp2_dp2"),
}

if __name__ == "__main__":
    import os
    import sys
    from pathlib import Path

    import harness  # this file's directory is on sys.path when run as a script

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    harness.CASES.update(CASES_3D)
    harness.main(Path(sys.argv[1]), list(CASES_3D))
