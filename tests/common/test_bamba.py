"""Bamba (Mamba2 mixers + attention) against transformers' BambaForCausalLM on random weights.

HF's model runs its pure-torch path here (no mamba_ssm / causal_conv1d on CPU), an independent
implementation of the same mixer: conv, segment-sum SSD scan, gated norm, half-rotary attention.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from baton.common.checkpoint import load_checkpoint, load_state_dict
from baton.common.config import ConfigError, ModelConfig
from baton.common.hf import export_hf, import_hf
from baton.common.hybrid_cache import HybridCache, cached_greedy_generate
from baton.common.model import build_model, greedy_generate
from baton.common.ssm import Mamba2Mixer

BATON = Path(sys.executable).parent / "baton"
# Four layers, attention at 1 and 3 (mixers at 0 and 2); two B/C groups; chunk 8, so a 29-token
# sequence spans four chunks, the last one partial.
HF_KW = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    attn_layer_indices=[1, 3],
    mamba_n_heads=4,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_chunk_size=8,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def baton(*args: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([str(BATON), *args], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A random HF Bamba saved with save_pretrained, and `baton convert --from-hf` of it."""
    tmp = tmp_path_factory.mktemp("bamba")
    torch.manual_seed(0)
    hf = transformers.BambaForCausalLM(transformers.BambaConfig(**HF_KW)).float().eval()
    with torch.no_grad():  # HF's init leaves A_log, D, dt_bias, norms and conv biases regular
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5) if not name.endswith("conv1d.bias") else p.normal_(0, 0.2)
    hf.save_pretrained(tmp / "hf")
    baton("convert", "--from-hf", str(tmp / "hf"), str(tmp / "baton"))
    return hf, tmp


def test_logits_match_hf(converted):
    hf, tmp = converted
    model = load_checkpoint(tmp / "baton").model.eval()
    assert model.config.model_type == "bamba" and model.config.attn_layer_indices == [1, 3]
    assert [hasattr(layer, "mamba") for layer in model.model.layers] == [True, False, True, False]
    tokens = torch.randint(0, 128, (3, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens, use_cache=False).logits
        out = model(tokens)
    assert ref.std() > 0.1, "logits are flat; the comparison would prove nothing"
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_logits_match_hf_with_the_other_options(tmp_path):
    """Biases on the mixer projections and attention, no conv bias, one B/C group, a clamped dt,
    tied embeddings, attention first: the options the main config leaves at their defaults."""
    kw = {
        **HF_KW,
        "attn_layer_indices": [0, 2],
        "mamba_n_groups": 1,
        "mamba_proj_bias": True,
        "mamba_conv_bias": False,
        "attention_bias": True,
        "time_step_limit": (0.05, 0.8),
        "tie_word_embeddings": True,
        "num_hidden_layers": 3,
    }
    torch.manual_seed(1)
    hf = transformers.BambaForCausalLM(transformers.BambaConfig(**kw)).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / "hf")
    model = load_checkpoint(import_hf(tmp_path / "hf", tmp_path / "b")).model.eval()
    assert model.config.time_step_limit == [0.05, 0.8] and model.config.mamba_proj_bias
    tokens = torch.randint(0, 128, (2, 21), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(tokens, use_cache=False).logits
        torch.testing.assert_close(model(tokens), ref, atol=1e-4, rtol=0)
    assert ref.std() > 0.1


def test_greedy_matches_hf_generate(converted):
    """HF decodes with its recurrent cache (conv window + SSM state); Baton re-runs the prefix."""
    hf, tmp = converted
    model = load_checkpoint(tmp / "baton").model.eval()
    prompt = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    ref = hf.generate(
        prompt,
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        attention_mask=torch.ones_like(prompt),
        pad_token_id=0,
    )[:, 7:]
    ours = greedy_generate(model, prompt, 12)
    assert torch.equal(ours, ref)
    # Baton carrying K/V and recurrent state, the prompt prefilled in pieces of 3 tokens.
    assert torch.equal(cached_greedy_generate(model, prompt, 12, prefill_chunk=3), ref)
    assert len(set(ours[0].tolist())) > 3, "degenerate generation; the comparison would prove little"


def test_export_round_trip(converted):
    """Export of the import (what --to-hf runs): the same tensors, bit for bit, and transformers
    reads the same model."""
    hf, tmp = converted
    export_hf(tmp / "baton", tmp / "hf2")
    original, again = load_state_dict(tmp / "hf"), load_state_dict(tmp / "hf2")
    assert original.keys() == again.keys()
    assert all(torch.equal(original[k], again[k]) for k in original)
    back = transformers.BambaForCausalLM.from_pretrained(tmp / "hf2").eval()
    for key in ("attn_layer_indices", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_chunk_size"):
        assert getattr(back.config, key) == getattr(hf.config, key), key
    assert tuple(back.config.time_step_limit) == tuple(hf.config.time_step_limit)
    assert back.config.rope_parameters["partial_rotary_factor"] == 0.5
    tokens = torch.randint(0, 128, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens, use_cache=False).logits, hf(tokens, use_cache=False).logits)


def test_cached_steps_equal_the_full_forward(converted):
    """Logits from the cache (prefill 5 + 6, then single tokens) equal one full forward."""
    _, tmp = converted
    model = load_checkpoint(tmp / "baton").model.eval()
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(3))
    cache = HybridCache()
    with torch.no_grad():
        full = model(tokens)
        pieces = [cache.forward(model, tokens[:, :5]), cache.forward(model, tokens[:, 5:11])]
        pieces += [cache.forward(model, tokens[:, t : t + 1]) for t in range(11, 17)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=0)
    assert sorted(cache.kv) == [1, 3] and sorted(cache.recurrent) == [0, 2]


def _cfg(**overrides) -> ModelConfig:
    hf_only = {"bos_token_id", "eos_token_id", "pad_token_id"}
    return ModelConfig(model_type="bamba", **{**{k: v for k, v in HF_KW.items() if k not in hf_only}, **overrides})


def test_mixer_carries_state_across_chunks_and_steps():
    """Prefill in two pieces, then token by token from the carried state, equals one pass."""
    torch.manual_seed(0)
    mixer = Mamba2Mixer(_cfg(), 0)
    with torch.no_grad():
        mixer.conv1d.bias.normal_(0, 0.2)
        x = torch.randn(2, 23, 32)
        whole = mixer(x)
        a, state = mixer.mix(x[:, :10])
        b, state = mixer.mix(x[:, 10:17], state)
        steps = [a, b]
        for t in range(17, 23):
            y, state = mixer.mix(x[:, t : t + 1], state)
            steps.append(y)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=0)
    assert state.conv.shape == (2, mixer.conv_dim, 3) and state.ssm.shape == (2, 4, 16, 16)


def test_backward_reaches_every_parameter():
    model = build_model(_cfg(), seed=0)
    tokens = torch.randint(0, 128, (2, 19))
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_config_shapes_and_errors():
    cfg = _cfg()
    assert cfg.mamba_d_head == 16 and cfg.rotary_dim == 4
    assert cfg.num_parameters() == sum(p.numel() for p in build_model(cfg).parameters())
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    llama = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    assert "mamba_n_heads" not in llama.to_dict()  # other families' dicts (and resume checks) unchanged
    for overrides, message in [
        (dict(mamba_n_heads=5), r"mamba_d_head \* mamba_n_heads"),
        (dict(mamba_n_groups=3), "mamba_n_heads .4. must be divisible by mamba_n_groups .3."),
        (dict(attn_layer_indices=[1, 4]), "attn_layer_indices must be distinct layer indices in 0..3"),
        (dict(head_dim=6, num_attention_heads=4), "head_dim must be a multiple of 4"),
        (dict(sliding_window=8), "bamba has no sliding-window attention"),
        (dict(time_step_limit=[1.0, 0.5]), "time_step_limit must be"),
    ]:
        with pytest.raises(ConfigError, match=message):
            _cfg(**overrides)
    with pytest.raises(ConfigError, match="attn_layer_indices picks Bamba's attention layers"):
        ModelConfig(**{**llama.to_dict(), "attn_layer_indices": [0]})


def test_served_handoff_gives_the_reference_greedy_tokens(converted):
    """The checkpoint served by the engine (state slots, paged attention; tests/serve/
    test_hybrid_serving.py covers the modes) decodes what the cache-free reference decoder does."""
    from baton.serve.engine import EngineConfig, LLMEngine
    from baton.serve.sampling_params import SamplingParams

    _, tmp = converted
    prompt = torch.randint(0, 128, (1, 21), generator=torch.Generator().manual_seed(4))
    ref = greedy_generate(load_checkpoint(tmp / "baton").model.eval(), prompt, 8)[0].tolist()
    engine = LLMEngine.from_checkpoint(tmp / "baton", EngineConfig(num_kv_blocks=16, block_size=8))
    engine.add_request("r", prompt[0].tolist(), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].outputs[0].token_ids == ref
