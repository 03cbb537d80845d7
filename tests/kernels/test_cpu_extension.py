"""The C++ CPU kernels' build: a lock left by a killed build is cleared at once while a live
builder is waited for, and a machine without a working compiler falls back to the torch path with
one warning (in a subprocess: the build is cached per process, and here it must fail). The tests
of the kernels themselves need a C++ compiler ("c++" in tests/system.py)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ..system import needs


def test_a_dead_builders_lock_is_cleared_and_a_failed_build_falls_back_to_torch_path(tmp_path):
    code = textwrap.dedent("""
        import logging, torch
        logging.basicConfig(level=logging.INFO)
        from baton.kernels import paged_attention as pa, reference as ref
        from baton.kernels.cpu_extension import build_directory, cpu_kernels
        folder = build_directory()
        folder.mkdir(parents=True)
        (folder / "lock").touch()  # left a moment ago by a build that was killed: torch would wait on it forever
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
    assert "removing the build lock of a build that did not finish" in run.stderr
    assert "waiting for it" not in run.stderr


def test_a_live_builder_is_waited_for_and_its_lock_kept(tmp_path):
    """While another process holds the builder lock (it is building), its torch lock file is left
    alone and the second process waits; it goes on once the builder is done."""
    import fcntl
    import time

    env = {**os.environ, "CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    where = "from baton.kernels.cpu_extension import build_directory; print(build_directory())"
    folder = subprocess.run([sys.executable, "-c", where], env=env, capture_output=True, text=True, check=True)
    folder = folder.stdout.strip()
    os.makedirs(folder)
    lock, log = os.path.join(folder, "lock"), tmp_path / "waiter.log"
    code = "import logging; logging.basicConfig(level=logging.INFO)\n"
    code += "from baton.kernels.cpu_extension import cpu_kernels; print(cpu_kernels())"
    with open(os.path.join(folder, "builder.flock"), "a") as held, open(log, "w") as err:
        fcntl.flock(held, fcntl.LOCK_EX)  # a live builder ...
        open(lock, "w").close()  # ... and its torch lock
        waiter = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        deadline = time.monotonic() + 120
        while "waiting for it" not in log.read_text() and time.monotonic() < deadline and waiter.poll() is None:
            time.sleep(0.1)
        time.sleep(1)
        assert waiter.poll() is None and os.path.exists(lock), log.read_text()  # waiting, the lock kept
        os.remove(lock)  # the builder finishes
    out, _ = waiter.communicate(timeout=300)  # (the flock is released as the file closes)
    assert waiter.returncode == 0, log.read_text()
    assert out.strip() == "None" and "could not build" in log.read_text()


@needs("c++")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 37])
def test_fused_elementwise_ops_match_the_torch_references(dtype, tokens):
    """The C++ RMSNorm (+ residual) and rotary against kernels/reference.py on strided views (the
    fused QKV output's q and k), and the dispatchers use them once the kernels are loaded."""
    from baton.kernels import apply_rotary, reference as ref, rms_norm
    from baton.kernels.cpu_extension import cpu_kernels, loaded_cpu_kernels

    m = cpu_kernels()
    assert m is not None and loaded_cpu_kernels(torch.ones(1, dtype=dtype)) is m
    g = torch.Generator().manual_seed(0)
    x, res = (torch.randn(1, tokens, 96, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(96, generator=g).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 2**-7}
    out, h = m.rms_norm(x, w, 1e-6, res)
    want, want_h = ref.rms_norm_ref(x, w, 1e-6, res)
    assert torch.equal(h, want_h)  # the sum is rounded to the dtype exactly as torch rounds it
    torch.testing.assert_close(out, want, **tol)
    torch.testing.assert_close(m.rms_norm(x, w, 1e-6)[0], ref.rms_norm_ref(x, w, 1e-6), **tol)
    torch.testing.assert_close(rms_norm(x, w, 1e-6, res)[0], want, **tol)
    # rows that do not collapse into one stride (a slice of a [B, S, H] batch, a transposed one): the
    # dispatcher hands the kernel a contiguous copy instead of failing (EAGLE's feats[:, 1:])
    batch = torch.randn(3, tokens + 1, 96, generator=g).to(dtype)
    for view in (batch[:, 1:], batch.transpose(0, 1)):
        torch.testing.assert_close(rms_norm(view, w, 1e-6), ref.rms_norm_ref(view, w, 1e-6), **tol)
        got, got_h = rms_norm(view, w, 1e-6, view)
        torch.testing.assert_close(got_h, view + view, **tol)
    qkv = torch.randn(tokens, (4 + 2 * 2) * 32, generator=g).to(dtype)
    q, k = qkv[:, :128].reshape(tokens, 4, 32), qkv[:, 128:192].reshape(tokens, 2, 32)
    cos, sin = (torch.randn(tokens, 32, generator=g).to(dtype) for _ in range(2))
    want_q, want_k = ref.apply_rotary_ref(q, k, cos, sin)
    for got_q, got_k in (m.rotary(q, k, cos, sin), apply_rotary(q, k, cos, sin)):
        torch.testing.assert_close(got_q, want_q, **tol)
        torch.testing.assert_close(got_k, want_k, **tol)
    assert loaded_cpu_kernels(x.requires_grad_()) is None  # no backward: autograd takes the torch path


@needs("c++")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1408), (37, 100), (2, 5, 96)])
def test_swiglu_matches_the_torch_reference_on_the_fused_projection_halves(dtype, shape):
    """silu(gate) * up on the strided halves of one gate/up GEMM output (what serve/fusion.py's MLP
    hands the dispatcher), incl. gates far in both tails (the clamped exponent), against the
    reference; the dispatcher returns the C++ op's result once the kernels are loaded."""
    from baton.kernels import reference as ref, swiglu
    from baton.kernels.cpu_extension import cpu_kernels

    m = cpu_kernels()
    g = torch.Generator().manual_seed(0)
    gate_up = (3 * torch.randn(*shape[:-1], 2 * shape[-1], generator=g)).to(dtype)
    gate_up[..., :3] = torch.tensor([-100.0, -89.0, 95.0]).to(dtype)
    gate, up = gate_up.chunk(2, -1)
    assert gate.stride(-2) == 2 * shape[-1]  # rows of the packed output
    want = ref.swiglu_ref(gate, up)
    got = m.swiglu(gate, up)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 2**-7}
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(swiglu(gate, up), got)
    torch.testing.assert_close(m.swiglu(gate.contiguous(), up.contiguous()), want, **tol)
    if dtype == torch.bfloat16:  # the bf16 result is the float32 kernel's on the same values, rounded by torch
        assert torch.equal(got, m.swiglu(gate.float(), up.float()).to(dtype))


def test_two_checkouts_of_the_same_sources_build_in_two_folders(tmp_path, monkeypatch):
    """torch's build.ninja names the sources by path: two checkouts sharing one folder would rebuild
    it back and forth (each load seeing the other's paths), so the folder depends on where they are."""
    import shutil

    from baton.kernels import cpu_extension as ce

    folders = []
    for checkout in ("a", "b"):
        csrc = Path(shutil.copytree(ce.SOURCES[0].parent, tmp_path / checkout / "csrc"))
        monkeypatch.setattr(ce, "SOURCES", [csrc / p.name for p in ce.SOURCES])
        monkeypatch.setattr(ce, "HEADERS", [csrc / p.name for p in ce.HEADERS])
        folders.append(ce.build_directory())
        assert ce.build_directory() == folders[-1]  # the same checkout: the same folder
    assert folders[0] != folders[1] and folders[0].parent == folders[1].parent
