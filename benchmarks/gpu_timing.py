"""The timing the prepared GPU scripts share (kernels_gpu.py, mla_gpu.py, gated_delta_gpu.py)."""

from __future__ import annotations

import statistics
import time

import torch


def median_ms(fn, device: torch.device, iters: int) -> float:
    """Median milliseconds of fn() over `iters` runs after one warm-up: CUDA events on a GPU (the
    kernels' own time, not the launch's), the wall clock elsewhere (the scripts' smoke mode)."""
    fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)
