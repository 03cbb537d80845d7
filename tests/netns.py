"""Two "nodes" on one machine, for multi-node tests: two network namespaces joined by a veth pair
(198.18.0.1 and 198.18.0.2, a benchmarking range no traffic leaves), each with lo up, its own
/etc/hosts naming both nodes (`ip netns exec` bind-mounts /etc/netns/NS/hosts over /etc/hosts,
so host names resolve as on a cluster), and commands run under their own host name (unshare
--uts). Everything is created by two_nodes() and removed when it exits, also on failure.

Needs root, iproute2 (`ip netns`) and util-linux (unshare, nsenter): two_nodes() requires "netns"
(tests/system.py), which skips the test where namespaces cannot be made, naming what is missing,
and fails it in CI."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .system import require

ADDRS = ("198.18.0.1", "198.18.0.2")
NETNS_ETC = Path("/etc/netns")


@dataclass(frozen=True)
class Node:
    netns: str
    dev: str  # its end of the veth pair: the interface gloo must use (GLOO_SOCKET_IFNAME)
    addr: str
    hostname: str

    def command(self, *args: str) -> list[str]:
        """`args` run on this node: in its namespace, under its host name."""
        return [
            *("ip", "netns", "exec", self.netns, "unshare", "--uts"),
            *("sh", "-c", f'hostname {self.hostname} && exec "$@"', "sh", *args),
        ]


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def two_nodes(hostnames: tuple[str, str] = ("baton-node0", "baton-node1")) -> Iterator[list[Node]]:
    require("netns")  # the tools, root, and a namespace made (and deleted) as a probe
    tag = f"{os.getpid()}"
    nodes = [Node(f"baton{tag}n{i}", f"bv{tag}n{i}", ADDRS[i], hostnames[i]) for i in range(2)]
    made_etc = not NETNS_ETC.exists()
    hosts = "127.0.0.1 localhost\n" + "".join(f"{n.addr} {n.hostname}\n" for n in nodes)
    try:
        for n in nodes:
            ip("netns", "add", n.netns)
        ip("link", "add", nodes[0].dev, "type", "veth", "peer", "name", nodes[1].dev)
        for n in nodes:
            (NETNS_ETC / n.netns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / n.netns / "hosts").write_text(hosts)
            ip("link", "set", n.dev, "netns", n.netns)
            ip("-n", n.netns, "addr", "add", f"{n.addr}/24", "dev", n.dev)
            ip("-n", n.netns, "link", "set", n.dev, "up")
            ip("-n", n.netns, "link", "set", "lo", "up")
        yield nodes
    finally:
        for n in nodes:  # deleting a namespace deletes its end of the pair, and so the pair
            subprocess.run(["ip", "netns", "del", n.netns], capture_output=True, timeout=30)
            shutil.rmtree(NETNS_ETC / n.netns, ignore_errors=True)
        if made_etc:
            with contextlib.suppress(OSError):
                NETNS_ETC.rmdir()
