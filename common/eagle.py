"""EAGLE draft head (Li et al., 2024): one autoregressive decoder layer over the target's features.

The head drafts at the feature level: row t takes the target's last hidden state at position t
and the embedding of token t + 1, mixes them (fc: 2H -> H), runs one decoder layer of the
target's own shape (the shared DecoderLayer) and predicts the feature at t + 1; the target's
frozen final norm and LM head turn that into the draft distribution of token t + 2. Drafting
further feeds the predicted feature back in with the drafted token.

The feature is the last hidden state at unit RMS, read off the normed state the target computes
anyway (normed / norm.weight): the final RMSNorm ignores a vector's scale, so norm(feature) is the
target's own normed state and the LM head gives the target's logits from a perfect prediction.

Only fc and the layer are the head's weights. They travel inside the handoff checkpoint as
eagle.safetensors + eagle_config.json (transformers ignores both); the embedding, final norm and
LM head are the target's (attached, never stored twice).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from baton.common.checkpoint import save_beside
from baton.common.config import ConfigError, ModelConfig
from baton.common.model import AttentionBackend, DecoderLayer, DenseCausalAttention, RMSNorm
from baton.common.rope import inv_frequencies, rotary_cos_sin
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

CONFIG_FILE = "eagle_config.json"
WEIGHTS_FILE = "eagle.safetensors"
RECIPE_HINT = "train one with an `eagle:` recipe (baton train --config configs/demo-eagle.yaml)"


@dataclass
class EagleConfig:
    layer: dict  # the target's ModelConfig fields: the head's decoder layer has the target's shapes

    @property
    def model_config(self) -> ModelConfig:
        """One decoder layer of the target's: of its last layer's attention type where types mix."""
        types = self.layer.get("layer_types")
        one = {**self.layer, "num_hidden_layers": 1, "layer_types": types[-1:] if types else None}
        if one.get("mlp_only_layers"):
            one["mlp_only_layers"] = None  # (Qwen3-MoE's layer indices; an MoE target is refused below)
        return ModelConfig.from_dict(one)


def features(normed: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """The target's normed last hidden state -> the unit-RMS feature the head reads and predicts."""
    w = norm.weight
    return normed / torch.where(w.abs() < 1e-6, torch.full_like(w, 1e-6), w)


class EagleHead(nn.Module):
    def __init__(self, cfg: EagleConfig):
        super().__init__()
        self.config = cfg
        mc = cfg.model_config
        if mc.is_hybrid or mc.num_local_experts:
            raise ValueError("the EAGLE head is a dense attention layer: a Bamba or MoE target is not supported")
        if mc.scale_embeddings or mc.final_logit_softcapping is not None or mc.sliding_rope_theta is not None:
            raise ValueError(
                f"the EAGLE head reads the target's embeddings and LM head as plain layers: a {mc.model_type} target "
                "(scaled embeddings, soft-capped logits or a second rope) is not supported yet"
            )
        self.fc = nn.Linear(2 * mc.hidden_size, mc.hidden_size)
        self.layer = DecoderLayer(mc, 0)
        self.inv_freq = inv_frequencies(mc.rotary_dim, mc.rope_theta, mc.rope_scaling)  # (float32, not a buffer)
        self.target: tuple[nn.Embedding, RMSNorm, nn.Linear] | None = None  # a tuple: not submodules

    def attach(self, embed: nn.Embedding, norm: RMSNorm, lm_head: nn.Linear) -> EagleHead:
        """The target's embedding, final norm and LM head (frozen, shared: not in state_dict)."""
        self.target = (embed, norm, lm_head)
        return self

    def forward(
        self,
        feats: torch.Tensor,
        next_tokens: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend | None = None,
    ) -> torch.Tensor:
        """feats [B, S, H] at `positions` [B, S], next_tokens [B, S] (token t + 1 of row t) ->
        predicted features of position t + 1, [B, S, H]."""
        embed, _, _ = self.target
        x = self.fc(torch.cat([feats, embed(next_tokens).to(feats.dtype)], dim=-1))
        if self.inv_freq.device != x.device:
            self.inv_freq = self.inv_freq.to(x.device)
        cos, sin = rotary_cos_sin(self.inv_freq, positions, x.dtype)
        return self.layer(x, cos, sin, attn or DenseCausalAttention())

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Draft logits of the token after a predicted feature: the target's norm and LM head."""
        _, norm, lm_head = self.target
        return lm_head(norm(feats))


def save_eagle(head: EagleHead, directory: str | Path) -> None:
    """Weights first, config last, each via a temporary file and rename (common/checkpoint.py)."""
    save_beside(directory, head, head.config, WEIGHTS_FILE, CONFIG_FILE)


def has_eagle(directory: str | Path) -> bool:
    return (Path(directory) / CONFIG_FILE).is_file()


def check_eagle(directory: str | Path) -> None:
    """Before a server binds its port: a checkpoint served with EAGLE carries a head."""
    d = Path(directory)
    if (d / "config.json").is_file() and not has_eagle(d):
        raise ConfigError(f"--speculative eagle: {d} has no EAGLE head ({CONFIG_FILE}); {RECIPE_HINT}")


def _target_modules(directory: Path, cfg: ModelConfig) -> tuple[nn.Embedding, RMSNorm, nn.Linear]:
    """The target's embedding, final norm and LM head, read from its own weight files (the head
    runs beside a target that may be sharded over other processes)."""
    from baton.common.checkpoint import weight_files

    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    found: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        with safe_open(path, framework="pt") as f:
            for name in want & set(f.keys()):
                found[name] = f.get_tensor(name)
    if cfg.tie_word_embeddings:
        found.setdefault("lm_head.weight", found.get("model.embed_tokens.weight"))
    missing = sorted(n for n in want if found.get(n) is None)
    if missing:
        raise ValueError(f"{directory}: the EAGLE head needs the target's {', '.join(missing)}")
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    with torch.no_grad():
        for module, name in (
            (embed, "model.embed_tokens.weight"),
            (norm, "model.norm.weight"),
            (lm_head, "lm_head.weight"),
        ):
            module.weight.copy_(found[name])
    return embed, norm, lm_head


def load_eagle(
    directory: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> EagleHead:
    """The head in `directory`, attached to that checkpoint's embedding, final norm and LM head."""
    d = Path(directory)
    if not has_eagle(d):
        raise FileNotFoundError(f"{d} has no EAGLE head ({CONFIG_FILE}): {RECIPE_HINT}")
    head = EagleHead(EagleConfig(**json.loads((d / CONFIG_FILE).read_text())))
    head.load_state_dict(load_file(d / WEIGHTS_FILE))
    target = [m.to(device=device, dtype=dtype).eval() for m in _target_modules(d, head.config.model_config)]
    head = head.to(device=device, dtype=dtype).eval().attach(*target)
    for p in [*head.parameters(), *(q for m in target for q in m.parameters())]:
        p.requires_grad_(False)
    return head
