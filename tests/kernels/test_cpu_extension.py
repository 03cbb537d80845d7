"""The C++ CPU kernels' build: a lock left by a killed build is cleared, and a machine without a
working compiler falls back to the torch path with one warning (in a subprocess: the build is
cached per process, and here it must fail)."""

import os
import subprocess
import sys
import textwrap


def test_stale_lock_is_cleared_and_a_failed_build_falls_back_to_torch_path(tmp_path):
    code = textwrap.dedent("""
        import logging, torch
        logging.basicConfig(level=logging.WARNING)
        from baton.kernels import paged_attention as pa, reference as ref
        import os, time
        from baton.kernels.cpu_extension import build_directory, cpu_kernels
        folder = build_directory()
        folder.mkdir(parents=True)
        (folder / "lock").touch()  # left by a build killed an hour ago: torch would wait on it forever
        os.utime(folder / "lock", (time.time() - 3600, time.time() - 3600))
        assert cpu_kernels() is None
        q, k, v = torch.randn(2, 4, 32), torch.randn(6, 16, 2, 32), torch.randn(6, 16, 2, 32)
        tables, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([20, 7], dtype=torch.int32)
        assert not pa.cpu_kernel_fits(q, k, v)
        torch.testing.assert_close(pa.paged_attention_decode(q, k, v, tables, lens),
                                   ref.paged_attention_decode_ref(q, k, v, tables, lens))
        print("fell back")
    """)
    env = {**os.environ, "CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "fell back" in run.stdout
    assert "could not build Baton's C++ CPU kernels" in run.stderr
    assert "using the slower torch paths" in run.stderr
    assert "removing a stale build lock" in run.stderr
