"""The offline API as vLLM spells it: `from baton.serve import LLM, SamplingParams`, and prompts
given as text, token ids or vLLM's {"prompt_token_ids": [...]}."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_import_from_the_package_is_lazy():
    code = (
        "import sys, baton.serve; assert 'torch' not in sys.modules, 'import baton.serve loaded torch'\n"
        "from baton.serve import LLM, SamplingParams\n"
        "from baton.serve.llm import LLM as L; from baton.serve.sampling_params import SamplingParams as S\n"
        "assert (LLM, SamplingParams) == (L, S)\n"
        "try:\n    from baton.serve import Nothing\nexcept ImportError:\n    pass\nelse:\n    raise SystemExit(1)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_token_prompts_as_vllm_writes_them(llama_dir):
    from baton.serve import LLM, SamplingParams
    from baton.serve.engine import EngineConfig

    llm = LLM(llama_dir, EngineConfig(num_kv_blocks=64, block_size=8))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = [llm.engine.tokenizer.encode(t) for t in ("The quick brown fox", "def f(x):")]
    want = [o.outputs[0].token_ids for o in llm.generate(ids, params)]
    one = llm.generate({"prompt_token_ids": ids[0]}, params)
    assert [o.outputs[0].token_ids for o in one] == want[:1] and one[0].prompt_token_ids == ids[0]
    many = llm.generate([{"prompt_token_ids": i} for i in ids], params)
    assert [o.outputs[0].token_ids for o in many] == want
    mixed = llm.generate(["The quick brown fox", {"prompt_token_ids": ids[1]}], params)
    assert [o.outputs[0].token_ids for o in mixed] == want
    for bad in ({"prompt": "The fox"}, {"prompt_token_ids": ids[0], "multi_modal_data": {}}, {}):
        with pytest.raises(ValueError, match="'prompt_token_ids'"):
            llm.generate([ids[0], bad], params)
    assert not llm.engine.has_unfinished_requests(), "a bad prompt is refused before any is scheduled"


def test_the_offline_llm_asks_for_final_outputs_only(llama_dir):
    """LLM.generate reads finished outputs alone, so its requests ask for no other (vLLM's
    FINAL_ONLY; building 64 outputs a step was 0.4 ms of a 13 ms decode step): the one output is
    what a streamed request ends with, its delta the whole completion."""
    from baton.serve import LLM, SamplingParams
    from baton.serve.engine import EngineConfig

    llm = LLM(llama_dir, EngineConfig(num_kv_blocks=64, block_size=8))
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=2, seed=0)
    engine.add_request("streamed", "The quick brown fox", params)
    engine.add_request("final", "The quick brown fox", params, final_only=True)
    got: dict[str, list] = {"streamed": [], "final": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].append(out)
    assert len(got["streamed"]) == 6 and len(got["final"]) == 1 and got["final"][0].finished
    last, final = got["streamed"][-1], got["final"][0]
    for a, b in zip(last.outputs, final.outputs, strict=True):
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
        assert b.delta_token_ids == b.token_ids and b.delta_text == b.text
    assert final.metrics.num_generated_tokens == last.metrics.num_generated_tokens == 12
    want = [o.outputs[0].token_ids for o in llm.generate(["The quick brown fox"], params)]
    assert want == [last.outputs[0].token_ids]
