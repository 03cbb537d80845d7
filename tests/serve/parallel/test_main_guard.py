"""A script that serves with tensor parallelism needs `if __name__ == "__main__":` (the workers are
spawned processes that import it again): without one it is refused before any worker starts, with
a line saying what to do; with one it runs, and its greedy tokens equal one process's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ..server_fixtures import offline

BODY = """
from baton.serve import LLM, SamplingParams
from baton.serve.engine import EngineConfig
from baton.serve.parallel.config import ParallelConfig

cfg = EngineConfig(num_kv_blocks=64, block_size=8, parallel=ParallelConfig(tensor_parallel_size=2))
llm = LLM({model!r}, cfg)
out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=6))
print("TOKENS", out[0].outputs[0].token_ids)
llm.shutdown()
"""


@pytest.mark.slow
def test_unguarded_script_is_refused_and_a_guarded_one_serves(llama_dir, tmp_path):
    body = BODY.format(model=str(llama_dir))
    unguarded = tmp_path / "unguarded.py"
    unguarded.write_text(body)
    run = subprocess.run([sys.executable, str(unguarded)], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert 'has no `if __name__ == "__main__":` guard' in run.stderr and "baton-worker" not in run.stderr, run.stderr

    guarded = tmp_path / "guarded.py"
    guarded.write_text('if __name__ == "__main__":\n' + textwrap.indent(body, "    "))
    run = subprocess.run([sys.executable, str(guarded)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    tokens = next(line for line in run.stdout.splitlines() if line.startswith("TOKENS"))
    assert tokens == f"TOKENS {offline(llama_dir, ['The quick brown fox'], 6)[0][0]}"
