"""Two nodes for real: two network namespaces joined by a veth pair (tests/netns.py: 198.18.0.1
and 198.18.0.2, a benchmarking range no traffic leaves), one torchrun in each (--nnodes 2, one
rank per node), each running `baton serve -tp 2`. Rank 0 serves gRPC on 198.18.0.1; a client
inside that namespace gets greedy tokens equal to the single-process offline engine's; SIGTERM to
the driver drains it and stops the worker in the other namespace; both torchruns exit 0. The
namespaces are deleted after.

Needs root and iproute2 (`ip netns`): "netns" in tests/system.py, skipped where namespaces cannot
be made (failed instead in CI)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ...netns import ADDRS, two_nodes
from ..server_fixtures import PROMPTS, offline

pytestmark = pytest.mark.slow
MAX_TOKENS = 16
MASTER_PORT, GRPC_PORT = 29500, 8001  # each namespace has its own ports: nothing else listens there
CLIENT = """
import json, sys, time
from baton.serve.client import BatonClient
with BatonClient(sys.argv[1], timeout=60) as c:
    if sys.argv[2] == "generate":
        out = {"health": c.health(), "tokens": []}
        for prompt in json.loads(sys.argv[3]):
            msgs = c.generate(prompt, max_tokens=int(sys.argv[4]), temperature=0)
            out["tokens"].append([t for m in msgs for t in m.completions[0].token_ids])
    else:  # wait until health is not SERVING; when (wall clock: the test compares it with its own)
        deadline = time.monotonic() + 60
        while c.health() == "SERVING" and time.monotonic() < deadline:
            time.sleep(0.01)
        out = {"health": c.health(), "at": time.time(), "reason": c.server_info().failure_reason}
print(json.dumps(out))
"""


@pytest.fixture
def namespaces():
    """The two nodes (tests/netns.py), created for the test and deleted after it."""
    with two_nodes() as nodes:
        yield nodes


def in_namespace(ns: str, *args: str, env: dict[str, str]) -> dict:
    """The client above, run inside namespace `ns` (the only place the server's address is reachable)."""
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT, f"{ADDRS[0]}:{GRPC_PORT}", *args]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert got.returncode == 0, got.stderr
    return json.loads(got.stdout)


@pytest.mark.parametrize("end", ["sigterm", "worker_killed"])
def test_two_nodes_serve_one_sharded_model(llama_dir, tmp_path, namespaces, end):
    """Greedy over two nodes equals one process; then either SIGTERM to the driver stops both nodes,
    or a SIGKILLed worker on the other node (no process handle there: only the heartbeat's round
    trip can tell) turns health NOT_SERVING, naming the cause."""
    reference = [ids for ids, _, _ in offline(llama_dir, PROMPTS[:3], MAX_TOKENS)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    logs, procs = [tmp_path / f"node{k}.log" for k in range(2)], []
    try:
        for k, node in enumerate(namespaces):
            cmd = node.command(  # in its namespace, under its own host name, like a node
                *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"),
                *("--node-rank", str(k), "--master-addr", ADDRS[0], "--master-port", str(MASTER_PORT)),
                *("-m", "baton.common.cli", "serve", "--model", str(llama_dir), "-tp", "2"),
                *("--host", ADDRS[0], "--port", str(GRPC_PORT), "--metrics-port", "-1"),
                *("--num-kv-blocks", "64", "--block-size", "8", "--heartbeat-s", "0.5"),
            )
            out = open(logs[k], "w")
            node_env = {**env, "GLOO_SOCKET_IFNAME": node.dev}  # gloo's interface: the veth, not the host's
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=node_env))
        deadline = time.monotonic() + 180
        while "ready: model=" not in logs[0].read_text():
            dead = [p.returncode for p in procs if p.poll() is not None]
            assert not dead and time.monotonic() < deadline, "\n---\n".join(log.read_text()[-3000:] for log in logs)
            time.sleep(0.2)
        text = logs[0].read_text()
        assert "2 ranks ready" in text and "workers started by the launcher" in text, text
        # Other host names: the tensor-parallel all-reduces cross the veth, not /dev/shm.
        assert "TP collectives ['gloo/nccl', 'gloo/nccl']" in text, text

        answer = in_namespace(namespaces[0].netns, "generate", json.dumps(PROMPTS[:3]), str(MAX_TOKENS), env=env)
        assert answer["health"] == "SERVING" and answer["tokens"] == reference, (answer, reference)
        (driver,), (worker,) = (psutil.Process(p.pid).children() for p in procs)  # torchrun's children
        if end == "sigterm":  # the driver drains and tells the worker in the other namespace to stop
            t0 = time.monotonic()
            driver.send_signal(signal.SIGTERM)
            codes = [p.wait(timeout=60) for p in procs]
            assert codes == [0, 0], "\n---\n".join(log.read_text()[-3000:] for log in logs)
            assert "rank 1 stopping" in logs[1].read_text()
            print(f"two nodes: both stopped {time.monotonic() - t0:.1f} s after SIGTERM to the driver")
        else:
            killed = time.time()
            worker.kill()
            seen = in_namespace(namespaces[0].netns, "wait", env=env)
            assert seen["health"] == "NOT_SERVING" and "a worker rank" in seen["reason"], seen
            assert seen["at"] - killed < 10, seen
            assert procs[1].wait(timeout=60) != 0  # that node's torchrun reports its worker's death
            driver.send_signal(signal.SIGTERM)
            driver.wait(timeout=60)  # the server drains (nothing in flight) and exits
            assert logs[0].read_text().rstrip().endswith("INFO baton.serve.server: stopped"), logs[0].read_text()
            # (torchrun's agent on this node then waits in its exit barrier for the other node's,
            # which died with its worker: up to 300 s, torchrun's own timeout; the finally ends it.)
            print(f"two nodes: NOT_SERVING {seen['at'] - killed:.2f} s after the remote worker was killed")
    finally:
        for p in procs:
            for child in psutil.Process(p.pid).children(recursive=True) if p.poll() is None else []:
                child.kill()
            if p.poll() is None:
                p.kill()
                p.wait(10)
