"""Handoff: what training hands over (from ZeRO-3 shards of two ranks, ZeRO-2 with optimizer offload, and
the plain-PyTorch backend) holds the trained weights as read without Baton's checkpoint code (DeepSpeed's
own zero_to_fp32 consolidation, or the trainer's safetensors file), and loads in transformers with the
logits of a Baton model built from those reference weights."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from baton.common.checkpoint import load_checkpoint, read_config, verify_hashes
from baton.common.model import build_model
from baton.common.tokenizer import Tokenizer

from .conftest import STEPS, run

pytestmark = pytest.mark.slow
PROMPT = "ROMEO:\nWhat light through yonder window"


def reference_weights(out: Path) -> dict[str, torch.Tensor]:
    """The final step's fp32 weights, independently of Baton's readers (which the export uses):
    DeepSpeed's own zero_to_fp32 for ZeRO shards, the safetensors file the PyTorch backend wrote."""
    ckpt = out / "checkpoints" / f"step_{STEPS:08d}"
    if json.loads((ckpt / "trainer_state.json").read_text())["layout"]["backend"] == "deepspeed":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="zero"))
    return load_file(ckpt / "model.safetensors")


def stored_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """The tensors as written to disk (every safetensors shard), not as Baton loads them back."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def check_against_reference(out: Path, exported: Path) -> None:
    """Exported tensors equal the reference weights, and transformers' model of the exported directory
    gives the logits of Baton's model built from the reference weights (the training run's config)."""
    from transformers import AutoModelForCausalLM

    ref, stored = reference_weights(out), stored_tensors(exported)
    assert sorted(stored) == sorted(ref)
    for name, t in stored.items():
        assert t.shape == ref[name].shape and torch.equal(t, ref[name].to(t.dtype)), name
    loaded = load_checkpoint(exported).model.state_dict()  # hashes and shapes checked on the way
    assert all(torch.equal(loaded[k], stored[k]) for k in stored)
    model = build_model(read_config(out / "checkpoints" / f"step_{STEPS:08d}"), seed=None)
    model.load_state_dict(ref, strict=True)
    ids = torch.tensor([Tokenizer.from_dir(exported).encode(PROMPT)])
    hf = AutoModelForCausalLM.from_pretrained(exported).eval()
    with torch.no_grad():
        ours, theirs = model.eval()(ids), hf(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_exported_zero3_checkpoint_loads_in_transformers_and_the_server_with_equal_logits(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = runs.get("z3-2")
    handoff = out / "handoff"
    verify_hashes(handoff)
    meta = json.loads((handoff / "baton.json").read_text())
    assert meta["step"] == STEPS and meta["parallel_layout"]["dp"] == 2 and meta["training"]["zero_stage"] == 3
    check_against_reference(out, handoff)

    tok = Tokenizer.from_dir(handoff)
    assert AutoTokenizer.from_pretrained(handoff)("ROMEO:\nWhat light")["input_ids"] == tok.encode("ROMEO:\nWhat light")
    hf = AutoModelForCausalLM.from_pretrained(handoff).eval()
    from baton.serve.llm import LLM
    from baton.serve.sampling_params import SamplingParams

    prompt = tok.encode(PROMPT)[:12]
    got = LLM(handoff).generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(6):  # transformers' greedy continuation, one token at a time
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    assert list(got.token_ids) == seq[len(prompt) :]


def test_baton_export_consolidates_any_checkpoint(runs, tmp_path):
    for mode in ("torch-1", "z2-offload-2"):
        out = runs.get(mode)
        run(1, ["export", str(out), str(tmp_path / mode)], tmp_path / f"{mode}.log")  # the latest: step 20
        assert json.loads((tmp_path / mode / "baton.json").read_text())["step"] == STEPS
        check_against_reference(out, tmp_path / mode)
