"""The tensor-parallel collectives inside the layers: gloo/NCCL, or shared memory on one CPU host.

Two all-reduces per layer are on the critical path of every step. Over gloo each one is a TCP
round trip through the kernel (0.5-0.8 ms on this 2-core machine for a decode batch, measured);
ranks on one host can instead meet in a shared-memory buffer, as vLLM's CPU backend does:

  step n: rank i copies its tensor into slot i of buffer n % 2, then publishes n in its flag;
  when every flag reads >= n, each rank sums slots 0..T-1 in that order (so every rank gets the
  same bits) into its own tensor.

Two buffers alternate, so a rank that runs ahead into step n+1 writes the buffer of step n-1,
which every rank has finished reading (it published n only after reading n-1). The flag is written
after the data; x86's total store order makes the data visible first, so the shared-memory path is
used only on x86-64 Linux CPUs (elsewhere, and on CUDA, the collectives are the process group's).
A waiting rank checks a few times, then sleeps in futex(2) on the flag it waits for and is woken by
the rank that publishes it: spinning instead costs milliseconds as soon as ranks outnumber free
cores (the waiter keeps the core the publisher needs), while a futex wake is a few microseconds.
A rank that stays silent past the timeout (dead or hung) makes the wait raise.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time
import uuid

import torch
import torch.distributed as dist


def all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    """Sum `t` in place over the tensor-parallel group (a ShmGroup or a process group)."""
    if isinstance(group, ShmGroup):
        return group.all_reduce(t)
    dist.all_reduce(t, group=group)
    return t


def all_gather(t: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    """Every rank's `t`, in rank order."""
    if isinstance(group, ShmGroup):
        return group.all_gather(t)
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def shared_memory_usable(device: torch.device) -> bool:
    return device.type == "cpu" and platform.system() == "Linux" and platform.machine() == "x86_64"


_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1  # x86-64; shared (not private) futexes: across processes


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_WAIT_SLICE = _Timespec(0, 50_000_000)  # re-check the deadline every 50 ms
_WRAP = 2**30  # collective numbers, modulo (an even number: the buffer of collective n is n % 2)


def _futex_wait(addr: int, expected: int) -> None:
    """Sleep while the int32 at `addr` equals `expected` (at most one slice; spurious wakes are fine)."""
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, expected, ctypes.byref(_WAIT_SLICE), None, 0)


def _futex_wake(addr: int) -> None:
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, 2**31 - 1, None, None, 0)


def pid_running(pid: int) -> bool:
    """Alive, and not a zombie (a killed worker stays one until its parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


class ShmGroup:
    """A tensor-parallel group whose ranks share one host: collectives through /dev/shm. Tensors
    larger than the buffer go through the process group (every rank decides the same way: the
    sizes of a collective agree)."""

    SPIN = 64  # flag checks before sleeping on it

    def __init__(
        self, group, rank: int, size: int, capacity_bytes: int, leader_global_rank: int, timeout_s: float = 300.0
    ):
        self.group, self.rank, self.size, self.timeout_s = group, rank, size, timeout_s
        self.capacity = -(-capacity_bytes // 64) * 64  # slots stay aligned for any dtype
        self.seq = 0
        name = [f"/dev/shm/baton-tp-{uuid.uuid4().hex}" if rank == 0 else None]
        dist.broadcast_object_list(name, src=leader_global_rank, group=group)
        self.pids: list = [None] * size  # one host: a waiter can see a peer die (no socket breaks here)
        dist.all_gather_object(self.pids, os.getpid(), group=group)
        flag_bytes = 64 * size  # one cache line per flag
        total = flag_bytes + 2 * size * self.capacity
        mem = torch.from_file(name[0], shared=True, size=total, dtype=torch.uint8)
        dist.barrier(group=group)  # every rank has it mapped: the name can go
        if rank == 0:
            os.unlink(name[0])
        self._mem = mem
        self.flags = mem[:flag_bytes].view(torch.int32)[::16]  # flag i: an int32 at byte 64 * i
        self.flags.zero_()  # (only rank 0's zeros matter: the file is new)
        cap = self.capacity
        self.buffers = [
            mem[flag_bytes + b * size * cap : flag_bytes + (b + 1) * size * cap].view(size, cap) for b in range(2)
        ]

    def _publish(self, t: torch.Tensor) -> torch.Tensor | None:
        """Copy `t` into this step's slot and wait for every rank; the step's buffer [size, bytes]."""
        nbytes = t.numel() * t.element_size()
        if nbytes > self.capacity:
            return None
        self.seq = (self.seq + 1) % _WRAP
        buf = self.buffers[self.seq % 2]
        buf[self.rank, :nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
        self.flags[self.rank] = self.seq
        _futex_wake(self.flags[self.rank : self.rank + 1].data_ptr())
        for j in range(self.size):
            self._wait_for(j)
        return buf[:, :nbytes]

    def _wait_for(self, j: int) -> None:
        flag, addr = self.flags[j : j + 1], self.flags[j : j + 1].data_ptr()
        # A rank is at most one collective ahead of another: flag j is seq - 1 (not there yet), seq or
        # seq + 1 (it went on), counted modulo _WRAP (an int32 flag wraps after 2**30 collectives).
        for _ in range(self.SPIN):
            if (int(flag) - self.seq) % _WRAP <= 1:
                return
        deadline = time.monotonic() + self.timeout_s
        while ((seen := int(flag)) - self.seq) % _WRAP > 1:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensor-parallel rank {j} did not reach collective {self.seq} in {self.timeout_s} s"
                )
            if not pid_running(self.pids[j]):
                raise RuntimeError(f"tensor-parallel rank {j} (pid {self.pids[j]}) exited before collective {self.seq}")
            _futex_wait(addr, seen)

    def _slot(self, buf: torch.Tensor, i: int, like: torch.Tensor) -> torch.Tensor:
        return buf[i].view(like.dtype).view(like.shape)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        buf = self._publish(t)
        if buf is None:
            dist.all_reduce(t, group=self.group)
            return t
        t.copy_(self._slot(buf, 0, t))
        for i in range(1, self.size):
            t.add_(self._slot(buf, i, t))
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        buf = self._publish(t)
        if buf is None:
            parts = [torch.empty_like(t) for _ in range(self.size)]
            dist.all_gather(parts, t.contiguous(), group=self.group)
            return parts
        return [self._slot(buf, i, t).clone() for i in range(self.size)]
