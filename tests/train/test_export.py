"""Handoff: what training hands over (here from ZeRO-3 shards of two ranks) loads in the server's
LLM and in transformers, with the same logits as the trained weights."""

import json

import pytest
import torch

from baton.common.checkpoint import load_checkpoint, verify_hashes
from baton.common.tokenizer import Tokenizer
from baton.train.universal import read_any

from .conftest import STEPS, final_state, run

pytestmark = pytest.mark.slow


def test_exported_zero3_checkpoint_loads_in_transformers_and_the_server_with_equal_logits(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = runs.get("z3-2")
    handoff = out / "handoff"
    verify_hashes(handoff)
    meta = json.loads((handoff / "baton.json").read_text())
    assert meta["step"] == STEPS and meta["parallel_layout"]["dp"] == 2 and meta["training"]["zero_stage"] == 3
    trained = final_state(out).weights  # consolidated from the shards, independently of the handoff
    ckpt = load_checkpoint(handoff)
    assert all(torch.equal(ckpt.model.state_dict()[k], v) for k, v in trained.items())

    tok = Tokenizer.from_dir(handoff)
    ids = torch.tensor([tok.encode("ROMEO:\nWhat light through yonder window")])
    assert AutoTokenizer.from_pretrained(handoff)("ROMEO:\nWhat light")["input_ids"] == tok.encode("ROMEO:\nWhat light")
    hf = AutoModelForCausalLM.from_pretrained(handoff).eval()
    with torch.no_grad():
        ours, theirs = ckpt.model.eval()(ids), hf(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

    from baton.serve.llm import LLM
    from baton.serve.sampling_params import SamplingParams

    prompt = ids[0, :12].tolist()
    out = LLM(handoff).generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(6):  # transformers' greedy continuation, one token at a time
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    assert list(out.token_ids) == seq[len(prompt):]


def test_baton_export_consolidates_any_checkpoint(runs, tmp_path):
    for mode in ("torch-1", "z2-offload-2"):
        out = runs.get(mode)
        run(1, ["export", str(out), str(tmp_path / mode)], tmp_path / f"{mode}.log")  # the latest: step 20
        exported = load_checkpoint(tmp_path / mode).model.state_dict()
        auto = load_checkpoint(out / "handoff").model.state_dict()
        assert all(torch.equal(exported[k], auto[k]) for k in auto)
        backend = "torch" if mode == "torch-1" else "deepspeed"
        weights = read_any(out / "checkpoints" / f"step_{STEPS:08d}", backend, with_optimizer=False).weights
        assert all(torch.equal(exported[k], w) for k, w in weights.items())
