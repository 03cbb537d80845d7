"""Every kernel, in the configurations its launcher picks, compiles for sm_90 and sm_80 (bundled ptxas)
and fits in shared memory: catches what only the GPU compiler sees (dot shapes, fp8 types, removed
APIs) without a GPU. The compiling happens in compile_all.py, run in the background (conftest)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("compile_all", Path(__file__).with_name("compile_all.py"))
compile_all = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compile_all)


@pytest.mark.slow
@pytest.mark.parametrize("target", list(compile_all.TARGETS))
@pytest.mark.parametrize("case", list(compile_all.CASES))
def test_compiles(compile_results, case, target):
    assert compile_results[case][target] == "ok", compile_results[case][target]
