"""DeepSeek-V3 in the shared model against transformers 5.25: DeepseekV3ForCausalLM for logits and
greedy tokens (random-weight models, loaded from their save_pretrained directories through Baton's
own loader), transformers' MtpModel for the MTP modules, and the absorbed form of latent attention
against the naive one."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import pytest
import torch
import transformers
from baton.common.checkpoint import load_checkpoint, load_state_dict, read_config, save_checkpoint
from baton.common.cli import main
from baton.common.config import ConfigError, ModelConfig
from baton.common.hf import config_from_hf, import_hf
from baton.common.model import CausalLM, DenseCausalAttention, greedy_generate, init_weights
from safetensors.torch import load_file, save_file
from transformers.modeling_layers import MtpModel

VOCAB = 97
# Odd widths throughout (hidden 72, 3 heads, nope 24, rope 8, v 20, latent 36): a transposed or
# mis-split head cannot line up by accident.
MLA = dict(
    vocab_size=VOCAB,
    hidden_size=72,
    intermediate_size=48,
    num_attention_heads=3,
    num_key_value_heads=3,
    kv_lora_rank=36,
    qk_nope_head_dim=24,
    qk_rope_head_dim=8,
    v_head_dim=20,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.7,  # != mscale: attention_factor != 1 on cos/sin, and the softmax scale moves too
}
CASES = {
    # V2-Lite's shape: no q_lora, every layer dense (n_routed_experts 0), DeepSeek's interleaved rope.
    "dense-no-qlora": dict(num_hidden_layers=2, q_lora_rank=None, n_routed_experts=0, first_k_dense_replace=2),
    # Low-rank q, YaRN with mscale_all_dim, rotate_half rope, a first dense layer, then 8 experts in 4
    # groups of which each token may use 2, two shared experts.
    "qlora-yarn-groups": dict(
        num_hidden_layers=3,
        q_lora_rank=28,
        rope_scaling=YARN,
        rope_interleave=False,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        n_shared_experts=2,
        moe_intermediate_size=20,
        first_k_dense_replace=1,
    ),
    # One group, no renormalisation, biases on the projections that have them, tied embeddings.
    "one-group-unnormed-bias-tied": dict(
        num_hidden_layers=2,
        q_lora_rank=16,
        n_routed_experts=6,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=12,
        first_k_dense_replace=0,
        norm_topk_prob=False,
        routed_scaling_factor=2.5,
        attention_bias=True,
        tie_word_embeddings=True,
    ),
}


def hf_model(name: str) -> transformers.DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**MLA, **CASES[name])).eval()
    with torch.no_grad():  # norms, biases and the routers' correction biases off their initial values
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """(name, HF model, its save_pretrained directory, Baton's model read from that directory by the
    loader `baton serve` and `init_from` use)."""
    hf = hf_model(request.param)
    hf_dir = tmp_path_factory.mktemp(request.param) / "hf"
    hf.save_pretrained(hf_dir)
    return request.param, hf, hf_dir, load_checkpoint(hf_dir).model.eval()


def tokens(b: int, s: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


def test_logits_and_greedy_equal_transformers(case):
    name, hf, _, ours = case
    x = tokens(2, 17, seed=1)
    with torch.no_grad():
        ref = hf(x).logits
        err = (ours(x) - ref).abs().max().item()
    assert err < 1e-4, f"{name}: max |logit diff| {err:.2e}"
    assert ref.std() > 0.3, "logits are flat; the comparison would prove nothing"
    prompt = x[:, :6]
    want = hf.generate(
        prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt)
    )[:, 6:]
    assert torch.equal(greedy_generate(ours, prompt, 12), want), f"{name}: greedy tokens differ"


def test_parameter_count_is_transformers(case):
    name, hf, _, ours = case
    n = sum(p.numel() for p in hf.parameters())
    assert ours.config.num_parameters() == n == sum(p.numel() for p in ours.parameters()), name


def test_a_checkpoint_without_mtp_weights_builds_none(case, caplog):
    """transformers writes num_nextn_predict_layers 1 (its default) with no MTP tensors."""
    _, _, hf_dir, ours = case
    assert json.loads((hf_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1
    with caplog.at_level(logging.INFO, logger="baton.common.checkpoint"):
        assert read_config(hf_dir).num_nextn_predict_layers == 0
    assert "no MTP modules" in caplog.text
    assert ours.mtp is None and ours.config.num_nextn_predict_layers == 0


class LatentBackend:
    """A backend with a latent cache's entry point, answering with MLAttention's absorbed reference."""

    def mla(self, q_nope, q_pe, latent, k_pe, layer):
        return layer.absorbed_reference(q_nope, q_pe, latent, k_pe)


@pytest.mark.parametrize("name", ["dense-no-qlora", "qlora-yarn-groups"])
def test_absorbed_attention_equals_the_naive_form(name):
    hf_cfg = transformers.DeepseekV3Config(**MLA, **CASES[name], num_mtp_layers=0)
    cfg = config_from_hf(json.loads(hf_cfg.to_json_string()))
    model = init_weights(CausalLM(cfg), seed=2).eval()
    x = tokens(2, 19, seed=3)
    with torch.no_grad():
        naive = model(x)
        absorbed = model(x, attn=LatentBackend())
        assert (naive - absorbed).abs().max() < 1e-5
        # One decode row against a cache of 19 latents: the last query of the naive layer.
        layer = model.model.layers[0].self_attn
        h = torch.randn(2, 19, cfg.hidden_size)
        cos, sin = (t.expand(2, -1, -1) for t in _cos_sin(model, 19))
        q_nope, q_pe, latent, k_pe = layer.project(h, cos, sin)
        last = layer.absorbed_reference(q_nope[:, -1:], q_pe[:, -1:], latent, k_pe)
        k_nope, v = layer.decompress(latent)
        k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, cfg.num_attention_heads, -1)], dim=-1)
        full = DenseCausalAttention()(torch.cat([q_nope, q_pe], dim=-1), k, v, layer)
        assert (last - full[:, -1:]).abs().max() < 1e-5
        assert layer.w_uk().shape == (3, 24, 36) and layer.w_uv().shape == (3, 20, 36)


def _cos_sin(model: CausalLM, s: int):
    from baton.common.rope import rotary_cos_sin

    return rotary_cos_sin(model.model.inv_freq, torch.arange(s)[None], torch.float32)


# ------------------------------------------------------------------------------------------ MTP
@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    """The MoE case saved by transformers, plus one MTP module as DeepSeek-V3 ships it (the layer after
    the last, with copies of the embedding and LM head): (HF model, directory)."""
    name = "qlora-yarn-groups"
    hf = hf_model(name)
    d = tmp_path_factory.mktemp("mtp") / "hf"
    hf.save_pretrained(d)
    n = hf.config.num_hidden_layers
    cfg = dataclasses.replace(read_config(d), num_nextn_predict_layers=1)
    module = init_weights(CausalLM(cfg), seed=4).checkpoint_state_dict()
    gen = torch.Generator().manual_seed(5)
    extra = {k: v + torch.randn(v.shape, generator=gen) * 0.2 * (v.dim() == 1) for k, v in module.items()}
    extra = {k: v for k, v in extra.items() if k.startswith(f"model.layers.{n}.")}
    extra[f"model.layers.{n}.mlp.gate.e_score_correction_bias"] = torch.randn(8, generator=gen) * 0.1
    weights = load_file(d / "model.safetensors")
    extra[f"model.layers.{n}.embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    extra[f"model.layers.{n}.shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file({**weights, **extra}, d / "model.safetensors", metadata={"format": "pt"})
    return hf, d


def test_mtp_logits_equal_transformers_mtp_model(mtp_dir):
    hf, d = mtp_dir
    ours = load_checkpoint(d).model.eval()
    assert len(ours.mtp) == 1 and ours.mtp[0].embed_tokens is None and ours.mtp[0].shared_head.head is None
    main = transformers.DeepseekV3ForCausalLM.from_pretrained(d).eval()  # (warns of the MTP keys, ignores them)
    # transformers reads MTP weights by its class's key pattern, written for 61 layers: point it at ours.
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{hf.config.num_hidden_layers}\..*"]
    ref_mtp = MtpModel.from_pretrained(main).eval()
    x = tokens(2, 15, seed=6)
    s = x.shape[1]
    with torch.no_grad():
        assert (main(x).logits - ours(x)).abs().max() < 1e-4
        hidden = main(x, output_hidden_states=True).hidden_states[-1]
        positions = torch.arange(1, s)[None].expand(2, -1)  # (HF: the tokens' positions; Baton: the hidden's)
        h = ref_mtp.forward_layer(0, hidden[:, :-1], positions, None, input_ids=x[:, 1:])
        ref = ref_mtp._project_to_logits(h)
        got = ours.mtp_logits(x)
        assert len(got) == 1 and got[0].shape == (2, s - 1, VOCAB)
        assert (got[0] - ref).abs().max() < 1e-4 and ref.std() > 0.3
        assert torch.equal(ours.mtp_logits(x, hidden=ours.hidden(x))[0], got[0])


def test_a_checkpoint_with_mtp_round_trips_through_convert(mtp_dir, tmp_path):
    _, d = mtp_dir
    baton, back = tmp_path / "baton", tmp_path / "hf_again"
    assert main(["convert", "--from-hf", str(d), str(baton)]) == 0
    assert main(["convert", "--to-hf", str(baton), str(back)]) == 0
    original, again = load_state_dict(d), load_state_dict(back)
    assert original.keys() == again.keys() == load_state_dict(baton).keys()
    assert any(".shared_head.head." in k for k in again)
    for key in original:
        assert original[key].dtype == again[key].dtype and torch.equal(original[key], again[key]), key
    baton_again = load_state_dict(import_hf(back, tmp_path / "baton_again"))  # and Baton -> HF -> Baton
    assert all(torch.equal(baton_again[k], v) for k, v in load_state_dict(baton).items())
    assert read_config(back).num_nextn_predict_layers == 1


def test_an_mtp_head_that_differs_from_lm_head_is_kept(mtp_dir, tmp_path):
    _, d = mtp_dir
    cfg = read_config(d)
    state = load_state_dict(d)
    head = f"model.layers.{cfg.num_hidden_layers}.shared_head.head.weight"
    state[head] = torch.randn(state[head].shape)
    shutil.copy(d / "config.json", tmp_path / "config.json")
    ours = load_checkpoint(save_checkpoint(tmp_path / "b", cfg, state)).model.eval()
    layer = ours.mtp[0]
    assert torch.equal(layer.shared_head.head.weight, state[head]) and layer.embed_tokens is None
    x = tokens(1, 9, seed=7)
    with torch.no_grad():
        want = (
            layer.norm_output(
                layer(
                    ours.hidden(x)[:, :-1],
                    x[:, 1:],
                    torch.arange(8)[None],
                    DenseCausalAttention(),
                    ours.model.embed,
                    ours.model.inv_freq,
                )
            )
            @ state[head].T
        )
        assert (ours.mtp_logits(x)[0] - want).abs().max() < 1e-5
    assert ours.checkpoint_state_dict()[head].equal(state[head])


# --------------------------------------------------------------------------------- config checks
DS = dict(MLA, model_type="deepseek_v3", num_hidden_layers=2, num_local_experts=8, n_group=4, topk_group=2)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(kv_lora_rank=None), "set kv_lora_rank"),
        (dict(qk_rope_head_dim=7), "qk_rope_head_dim must be even"),
        (dict(v_head_dim=0), "v_head_dim must be a positive integer"),
        (dict(num_key_value_heads=1), "num_key_value_heads (1) must equal num_attention_heads"),
        (dict(num_local_experts=6), "n_routed_experts, 6) must be divisible by n_group (4)"),
        (dict(topk_group=5), "topk_group must be in 1..n_group (4)"),
        (dict(n_group=8), "n_routed_experts / n_group must be >= 2"),
        (dict(num_experts_per_tok=5), "num_experts_per_tok (5) must be <= topk_group * experts per group (2 * 2)"),
        (dict(num_local_experts=0), "set num_local_experts > 0, or first_k_dense_replace >= num_hidden_layers"),
    ],
)
def test_a_bad_deepseek_config_fails_naming_the_field(changes, message):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**{**DS, **changes})
    assert message in str(e.value)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(model_type="llama", kv_lora_rank=16), "kv_lora_rank is DeepSeek-V3's"),
        (dict(model_type="mixtral", num_local_experts=4, n_group=2), "n_group is DeepSeek-V3's"),
        (dict(model_type="qwen3_moe", num_local_experts=4, num_nextn_predict_layers=1), "num_nextn_predict_layers"),
        (dict(model_type="llama", rope_interleave=True), "rope_interleave is DeepSeek-V3's"),
    ],
)
def test_deepseek_fields_are_refused_in_other_families(fields, message):
    with pytest.raises(ConfigError) as e:
        ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, **fields)
    assert message in str(e.value)


def test_deepseek_fields_stay_out_of_other_families_dicts():
    cfg = ModelConfig(**DS)
    assert cfg.is_mla and cfg.rotary_dim == cfg.head_dim == 8 and cfg.rope_interleave is True
    assert [cfg.is_moe_layer(i) for i in range(3)] == [True, True, True]
    assert [dataclasses.replace(cfg, first_k_dense_replace=1).is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    llama = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    assert not set(llama.to_dict()) & {"kv_lora_rank", "n_group", "rope_interleave", "num_nextn_predict_layers"}
