"""The shared-memory tensor-parallel collectives equal gloo's, across the buffer's edge and the
flag counter's wrap, and a rank that never arrives makes the wait raise instead of hang."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
import torch

from baton.serve.parallel.comm import shared_memory_usable

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not shared_memory_usable(torch.device("cpu")), reason="shared-memory path: x86-64 Linux only"),
]


RANK = """
import json, os, sys, time
import torch, torch.distributed as dist
from baton.serve.parallel import comm
from baton.serve.parallel.comm import ShmGroup

rank, port = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
group = dist.new_group([0, 1])
shm = ShmGroup(group, rank, 2, 64 * 1024, 0, timeout_s=2.0)
shm.seq = comm._WRAP - 5  # the counter wraps during the test
gen = torch.Generator().manual_seed(rank)
for shape in [(1, 8), (48, 64), (128, 128), (3, 5, 7)]:  # (128, 128) fp32 is past the 64 KiB buffer
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(shape, generator=gen).to(dtype)
        want = t.clone()
        dist.all_reduce(want, group=group)
        assert torch.equal(comm.all_reduce(t.clone(), shm), want), (shape, dtype)
        ref = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(ref, t, group=group)
        assert all(torch.equal(a, b) for a, b in zip(comm.all_gather(t, shm, 2), ref))
if rank == 1:
    print(json.dumps({"rank": 1, "ok": True}), flush=True)
    time.sleep(6)  # alive but never arriving (one that exits is seen at once): rank 0 must time out
    os._exit(0)
t0 = time.monotonic()
try:
    shm.all_reduce(torch.ones(4))
    print(json.dumps({"rank": 0, "raised": False}))
except RuntimeError as e:
    print(json.dumps({"rank": 0, "raised": True, "after": time.monotonic() - t0, "message": str(e)}))
"""


def test_shared_memory_collectives_equal_gloo_and_time_out(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(port)], stdout=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    outs = [json.loads(p.communicate(timeout=180)[0].strip().splitlines()[-1]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[1] == {"rank": 1, "ok": True}
    assert outs[0]["raised"] and 1.5 < outs[0]["after"] < 10, outs[0]
    assert "did not reach collective" in outs[0]["message"]
