"""LayerSkip training (Elhoushi et al., 2024): layer dropout rising with depth + an early-exit loss.

Both are applied from outside the model (torchtitan style), by forward hooks on its decoder layers,
and only while training with gradients on (evaluation and the handoff see the plain model):

  layer dropout   layer l (0-based) of L is skipped for a whole sample with probability
                  p_{l,t} = p_max * D(l) * S(t):  D(l) = l / (L-1) (linear) or e^{l ln2/(L-1)} - 1
                  (LayerSkip's exponential); S(t) = 1 (fine-tuning) or e^{t ln2/(T-1)} - 1 over the
                  T = max_steps steps (LayerSkip's pretraining warm-up). Skipping returns the layer's
                  input (no 1/(1-p) rescaling, as LayerSkip). The layer still runs for the whole
                  batch, so every parameter has a gradient on every rank (DDP's reducer needs that).
  early-exit loss the output after the first E layers, for each exit E, goes through the shared
                  final norm and LM head; the loss is sum_E w_E CE_E over the exits and the final
                  layer (E = L), with LayerSkip's weights rising with depth
                      e_E = e_scale * sum_{i<E} i  (exits)      e_L = (L-1) + e_scale * sum_{i<L-1} i
                  normalised over the exits active this step: all, or under the rotational
                  curriculum exit j when j % R == t % R (the final layer always).

The exits are recorded in the handoff's config.json (`early_exit_layers`), where serving finds them
(`baton serve --speculative layerskip`, `--early-exit-threshold`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from baton.common.model import CausalLM
from torch import nn

DROPOUT_SHAPES = ("linear", "exp")
DROPOUT_WARMUPS = ("none", "exp")
CURRICULA = ("none", "rotational")


@dataclass
class EarlyExitConfig:
    """The recipe's `early_exit:` section; off while exit_layers is empty and layer_dropout is 0."""

    exit_layers: list[int] = field(default_factory=list)  # E: the output after the first E layers, 2..L-1
    loss_scale: float = 1.0  # LayerSkip's e_scale: how much the exits weigh against the final layer
    curriculum: str = "none"  # none | rotational (exit j trains at step t when j % rotation == t % rotation)
    rotation: int = 2
    layer_dropout: float = 0.0  # p_max: the last layer's drop probability
    dropout_shape: str = "linear"  # linear | exp: how p rises with depth
    dropout_warmup: str = "none"  # none (fine-tuning) | exp: p rises from 0 over the run (pretraining)

    @property
    def enabled(self) -> bool:
        return bool(self.exit_layers) or self.layer_dropout > 0

    def check(self, need, num_layers: int) -> None:
        """Every value against the model's depth, before any work (need(cond, msg) raises ConfigError)."""
        e = self.exit_layers
        need(
            isinstance(e, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in e),
            f"early_exit.exit_layers must be a list of integers, got {e!r}",
        )
        need(e == sorted(set(e)), f"early_exit.exit_layers must be sorted and without repeats, got {e}")
        need(
            all(2 <= x < num_layers for x in e),
            f"early_exit.exit_layers must lie in 2..{num_layers - 1} (the output after E of the model's "
            f"{num_layers} layers; exit 1 weighs 0 under LayerSkip's scale, {num_layers} is the final layer), got {e}",
        )
        num = (int, float)
        need(
            isinstance(self.loss_scale, num) and not isinstance(self.loss_scale, bool) and self.loss_scale > 0,
            f"early_exit.loss_scale must be a number > 0, got {self.loss_scale!r}",
        )
        need(
            isinstance(self.layer_dropout, num) and 0 <= self.layer_dropout <= 1,
            f"early_exit.layer_dropout must be in [0, 1], got {self.layer_dropout!r}",
        )
        need(self.curriculum in CURRICULA, f"early_exit.curriculum must be one of {CURRICULA}, got {self.curriculum!r}")
        need(
            isinstance(self.rotation, int) and self.rotation >= 1,
            f"early_exit.rotation must be a positive integer, got {self.rotation!r}",
        )
        need(
            self.dropout_shape in DROPOUT_SHAPES,
            f"early_exit.dropout_shape must be one of {DROPOUT_SHAPES}, got {self.dropout_shape!r}",
        )
        need(
            self.dropout_warmup in DROPOUT_WARMUPS,
            f"early_exit.dropout_warmup must be one of {DROPOUT_WARMUPS}, got {self.dropout_warmup!r}",
        )


def dropout_rate(cfg: EarlyExitConfig, layer: int, num_layers: int, step: int, max_steps: int) -> float:
    """p_{l,t} = p_max * D(l) * S(t) (module docstring)."""
    if num_layers < 2 or cfg.layer_dropout == 0:
        return 0.0
    frac = layer / (num_layers - 1)
    depth = frac if cfg.dropout_shape == "linear" else math.exp(frac * math.log(2)) - 1
    time = 1.0
    if cfg.dropout_warmup == "exp":
        time = math.exp(min(step, max_steps - 1) / max(1, max_steps - 1) * math.log(2)) - 1
    return cfg.layer_dropout * depth * time


def exit_weights(cfg: EarlyExitConfig, num_layers: int, step: int) -> dict[int, float]:
    """{E: normalised weight} of the exits active at `step` and the final layer (E = num_layers)."""
    active = [
        e for j, e in enumerate(cfg.exit_layers) if cfg.curriculum == "none" or j % cfg.rotation == step % cfg.rotation
    ]
    raw = {e: cfg.loss_scale * e * (e - 1) / 2 for e in active}
    raw[num_layers] = (num_layers - 1) + cfg.loss_scale * (num_layers - 1) * (num_layers - 2) / 2
    total = sum(raw.values())
    return {e: w / total for e, w in raw.items()}


class EarlyExit:
    """The hooks on one model, and the loss that reads what they captured. `step` is set by the
    trainer before each optimizer step (it drives the curriculum and the dropout warm-up)."""

    def __init__(self, cfg: EarlyExitConfig, model: CausalLM, max_steps: int, seed: int):
        self.cfg, self.model, self.max_steps = cfg, model, max_steps
        self.num_layers = model.config.num_hidden_layers
        self.step = 0
        self.generator = torch.Generator().manual_seed(seed)  # this rank's own dropout draws
        self.exit_logits: dict[int, torch.Tensor] = {}
        self.losses: dict[int, list[torch.Tensor]] = {}  # per exit E (detached), since the last metrics() call
        layers = model.model.layers
        self.handles = [layers[i].register_forward_hook(self._layer_hook(i)) for i in range(self.num_layers)]

    def _layer_hook(self, i: int):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            if not (module.training and torch.is_grad_enabled()):
                return None
            x = args[0]
            p = dropout_rate(self.cfg, i, self.num_layers, self.step, self.max_steps)
            if p > 0:
                drop = torch.rand(x.shape[0], generator=self.generator) < p
                output = torch.where(drop.to(x.device)[:, None, None], x, output)
            if i + 1 < self.num_layers and i + 1 in self.weights:  # an active exit after the first i + 1 layers
                inner = self.model.model
                self.exit_logits[i + 1] = self.model.compute_logits(inner.final_norm(output))
            return output

        return hook

    @property
    def weights(self) -> dict[int, float]:
        return exit_weights(self.cfg, self.num_layers, self.step)

    def loss(self, logits: torch.Tensor, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the weighted loss to backpropagate, the final layer's own CE for the logs) of one
        micro-batch whose forward just ran; float32 cross-entropies, as lm_loss."""
        targets = batch[:, 1:].reshape(-1)
        ce = lambda z: F.cross_entropy(z.reshape(-1, z.shape[-1]).float(), targets)  # noqa: E731
        final = ce(logits)
        total = final.new_zeros(())
        for e, w in self.weights.items():
            part = final if e == self.num_layers else ce(self.exit_logits.pop(e))
            total = total + w * part
            if e != self.num_layers:
                self.losses.setdefault(e, []).append(part.detach())
        self.exit_logits.clear()
        return total, final

    def metrics(self) -> dict[str, float]:
        """Mean exit losses since the last call, as log records (`exit{E}_loss`)."""
        out = {f"exit{e}_loss": torch.stack(v).mean().item() for e, v in sorted(self.losses.items())}
        self.losses.clear()
        return out


def apply_early_exit(model: CausalLM, cfg: EarlyExitConfig, max_steps: int, seed: int) -> EarlyExit | None:
    """The LayerSkip hooks on `model` (None when the section is off)."""
    return EarlyExit(cfg, model, max_steps, seed) if cfg.enabled else None
