"""Qwen3.5 (dense, MoE) and Qwen3-Next in the shared model against transformers 5.25: logits, greedy
tokens, gradients and parameter counts of random-weight Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM /
Qwen3NextForCausalLM models loaded through Baton's loader from their save_pretrained directories; the
Gated DeltaNet rule's chunked and recurrent forms against a float64 reference and transformers' torch
fallbacks; the mixer's carried state (two pieces = one run, token by token = one run)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers
from baton.common.checkpoint import load_checkpoint, load_state_dict, read_config
from baton.common.cli import main
from baton.common.gated_deltanet import GatedDeltaNet
from baton.common.hf_config import config_from_hf
from baton.common.hybrid_cache import cached_greedy_generate
from baton.common.model import greedy_generate
from safetensors.torch import load_file, save_file

VOCAB = 97
# Odd widths (hidden 48, 3 heads of 16 over 1 KV head; DeltaNet: 2 key heads of 8 serving 4 value
# heads of 6, a conv of 3): a transposed head or a mis-split projection cannot line up by accident.
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    num_hidden_layers=4,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=6,
    linear_conv_kernel_dim=3,
    initializer_range=0.1,
)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=20)
CASES = {
    # transformers' default pattern (three DeltaNet layers, then attention), tied embeddings.
    "qwen3_5": (transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig, dict(intermediate_size=40)),
    "qwen3_5_moe": (
        transformers.Qwen3_5MoeForCausalLM,
        transformers.Qwen3_5MoeTextConfig,
        dict(**MOE, tie_word_embeddings=True),
    ),
    # Qwen3-Next's packed projections, alternating layers, a dense layer among the MoE ones, and YaRN
    # over half of each head (its factor on cos/sin reaches the rotated channels only).
    "qwen3_next": (
        transformers.Qwen3NextForCausalLM,
        transformers.Qwen3NextConfig,
        dict(
            **MOE,
            intermediate_size=40,
            mlp_only_layers=[2],
            layer_types=["linear_attention", "full_attention"] * 2,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 8,
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        ),
    ),
}


def hf_model(name: str):
    cls, config_cls, extra = CASES[name]
    torch.manual_seed(0)
    model = cls(config_cls(**COMMON, **extra)).eval()
    with torch.no_grad():  # (1 + w) norms, gated norms, A_log and dt_bias off their initial values
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """(name, HF model, its save_pretrained directory, Baton's model read from it by load_checkpoint)."""
    hf = hf_model(request.param)
    hf_dir = tmp_path_factory.mktemp(request.param) / "hf"
    hf.save_pretrained(hf_dir)
    return request.param, hf, hf_dir, load_checkpoint(hf_dir).model.eval()


def tokens(b: int, s: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


def test_logits_and_greedy_equal_transformers(case):
    name, hf, _, ours = case
    x = tokens(2, 29, seed=1)
    with torch.no_grad():
        ref = hf(x).logits
        err = (ours(x) - ref).abs().max().item()
    assert err < 1e-4, f"{name}: max |logit diff| {err:.2e}"
    assert ref.std() > 0.3, "logits are flat; the comparison would prove nothing"
    prompt = x[:, :7]
    want = hf.generate(
        prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(prompt)
    )[:, 7:]
    assert torch.equal(greedy_generate(ours, prompt, 10), want), f"{name}: greedy tokens differ"
    # The same tokens with the recurrent state carried: the prompt in pieces of 3, then one token a step.
    assert torch.equal(cached_greedy_generate(ours, prompt, 10, prefill_chunk=3), want), f"{name}: cached"


def test_gradients_equal_transformers(case):
    """Training's path: the chunked form's backward (and the gated attention's) against HF's."""
    name, hf, _, ours = case
    x = tokens(2, 21, seed=2)
    for model in (hf, ours):
        model.zero_grad()
        logits = model(x).logits if model is hf else model(x)
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()
    ref = {n: p.grad for n, p in hf.named_parameters()}
    got = {n: p.grad for n, p in ours.named_parameters()}
    shared = sorted(set(ref) & set(got))  # (all but HF's fused experts)
    assert any("linear_attn.A_log" in n for n in shared) and any("self_attn.q_proj" in n for n in shared)
    for n in shared:
        assert (got[n] - ref[n]).abs().max() < 1e-4 * (1 + ref[n].abs().max()), f"{name}: {n}"
    hf.zero_grad()
    ours.zero_grad()


def test_parameter_count_is_transformers(case):
    name, hf, _, ours = case
    n = sum(p.numel() for p in hf.parameters())
    assert ours.config.num_parameters() == n == sum(p.numel() for p in ours.parameters()), name


def test_convert_round_trip_loads_in_transformers(case, tmp_path):
    name, hf, hf_dir, _ = case
    baton, back = tmp_path / "baton", tmp_path / "hf_again"
    assert main(["convert", "--from-hf", str(hf_dir), str(baton)]) == 0
    assert main(["convert", "--to-hf", str(baton), str(back)]) == 0
    original, again = load_state_dict(hf_dir), load_state_dict(back)
    assert original.keys() == again.keys()
    assert all(torch.equal(original[k], again[k]) for k in original), name
    assert read_config(back) == read_config(hf_dir)
    reread = type(hf).from_pretrained(back).eval()
    x = tokens(1, 11, seed=3)
    with torch.no_grad():
        assert (reread(x).logits - hf(x).logits).abs().max() < 1e-5  # (its experts re-fused: other strides)


def test_a_multimodal_qwen3_5_checkpoint_reads_its_text_model(tmp_path, caplog):
    """Qwen3.5's own checkpoints: config.json nests the text model (text_config), the weights sit under
    model.language_model.* beside model.visual.*, and an MTP head ships as mtp.*."""
    hf = hf_model("qwen3_5")
    hf.save_pretrained(tmp_path)
    text = json.loads((tmp_path / "config.json").read_text())
    outer = transformers.Qwen3_5Config(text_config=text, tie_word_embeddings=False).to_json_string()
    (tmp_path / "config.json").write_text(outer)
    weights = load_file(tmp_path / "model.safetensors")
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in weights.items()}
    renamed |= {"model.visual.patch_embed.proj.weight": torch.zeros(4, 3), "mtp.fc.weight": torch.zeros(48, 96)}
    a_log = "model.language_model.layers.0.linear_attn.A_log"
    renamed[a_log] = renamed[a_log].double()  # (a decay parameter kept wider than the rest: read in the model's)
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="baton.common"):
        ours = load_checkpoint(tmp_path).model.eval()
    assert "multimodal qwen3_5 model" in caplog.text and "['model.visual', 'mtp']" in caplog.text
    x = tokens(2, 13, seed=4)
    with torch.no_grad():
        assert (ours(x) - hf(x).logits).abs().max() < 1e-4


# ---------------------------------------------------------------------------------- the rule
# The rule's forms (token loop, chunked, Triton) against a float64 reference and transformers' two
# torch functions: tests/kernels/test_gated_delta.py.


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_the_mixer_in_pieces_with_its_state_equals_one_run(name):
    """Prefill in two pieces (odd split), then decode token by token, carrying (conv, recurrent)."""
    mixer: GatedDeltaNet = load_mixer(name)
    x = torch.randn(2, 31, 48, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        whole, final = mixer(x)
        a, state = mixer(x[:, :11])
        b, state = mixer(x[:, 11:25], state)
        steps = []
        for t in range(25, 31):
            y, state = mixer(x[:, t : t + 1], state)
            steps.append(y)
    pieces = torch.cat([a, b, *steps], dim=1)
    assert (pieces - whole).abs().max() < 1e-5 and whole.std() > 0.05
    assert all((u - w).abs().max() < 1e-5 for u, w in zip(state, final))
    assert state.conv.shape == (2, mixer.conv_dim, 2) and state.recurrent.shape == (2, 4, 8, 6)
    empty = mixer.empty_state(2)
    assert all(torch.equal(e, torch.zeros_like(e)) for e in empty)
    with torch.no_grad():
        assert torch.equal(mixer(x, empty)[0], whole)


def load_mixer(name: str) -> GatedDeltaNet:
    """Layer 0's mixer of the HF model, its weights in Baton's GatedDeltaNet (the names are HF's)."""
    hf = hf_model(name)
    mixer = GatedDeltaNet(config_from_hf(json.loads(hf.config.to_json_string())), 0)
    mixer.load_state_dict(hf.model.layers[0].linear_attn.state_dict())
    return mixer.eval()
