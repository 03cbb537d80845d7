"""Calibration data from the training corpus, and layer-by-layer execution over it.

Calibration samples come from the *training* split and evaluation (baton.serve.eval) from the
*validation* split of the same `DataConfig` (the trainer's own), so they never overlap. The defaults
equal the demo recipe's data settings (configs/demo.yaml), so the demo model is evaluated on text it
never saw.
Methods that calibrate (GPTQ, AWQ, SmoothQuant) quantize one decoder layer at a time: the inputs of
layer i are the outputs of the already-quantized layers before it, as in the GPTQ paper. DeepSeek-V3's
MTP modules come after the last layer, fed from the quantized model's final hidden states.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from baton.common.data import DataConfig, build_datasets
from baton.common.model import CausalLM, DecoderLayer, DenseCausalAttention, run_layers
from baton.common.mtp import MTPLayer
from baton.common.tokenizer import Tokenizer
from baton.serve.quantization.linear import target_linears
from torch import nn


class CalibrationError(ValueError):
    """Calibration data that cannot support the requested quantization."""


def demo_corpus() -> DataConfig:
    """configs/demo.yaml's data settings: the embedded corpus in 128-token blocks, 2% held out."""
    return DataConfig(seq_len=128, val_fraction=0.02)


@dataclass
class CalibrationConfig:
    data: DataConfig = field(default_factory=demo_corpus)
    num_samples: int = 128
    sample_seed: int = 0  # which training blocks are drawn


def calibration_tokens(cfg: CalibrationConfig, tokenizer: Tokenizer) -> torch.Tensor:
    """[num_samples, seq_len] token ids: a seeded draw of training blocks."""
    if cfg.num_samples < 1:
        raise CalibrationError(f"num_samples must be at least 1, got {cfg.num_samples}")
    train, _ = build_datasets(cfg.data, tokenizer)
    if len(train) < cfg.num_samples:
        raise CalibrationError(
            f"calibration set too small: {cfg.data.path or 'the default corpus'} has {len(train)} "
            f"training blocks of {cfg.data.seq_len} tokens, {cfg.num_samples} requested"
        )
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.sample_seed))
    rows = train.with_format("torch")[order[: cfg.num_samples].sort().values.tolist()]["input_ids"]
    return rows[:, : cfg.data.seq_len].long()


def check_calibration_size(tokens: torch.Tensor, model: CausalLM) -> None:
    """Fewer tokens than a layer has inputs make its Hessian / channel statistics rank-deficient."""
    need = max(lin.in_features for lin in target_linears(model).values())
    if tokens.numel() < need:
        raise CalibrationError(
            f"calibration set too small: {tokens.numel()} tokens, fewer than the {need} input "
            f"channels of the widest layer; use more or longer samples"
        )


class LayerRunner:
    """Holds the calibration activations between decoder layers and feeds them through one layer."""

    def __init__(self, model: CausalLM, tokens: torch.Tensor, batch_size: int = 16):
        p = model.model.embed_tokens.weight
        tokens = tokens.to(p.device)
        self.batch_size = batch_size
        self.model, self.tokens = model, tokens
        with torch.no_grad():
            self.x = model.model.embed(tokens)  # (Gemma scales its embeddings)
        self.positions = torch.arange(tokens.shape[1], device=p.device).expand(min(batch_size, len(tokens)), -1)
        self.inv_freq = model.model.inv_freq.to(p.device)

    @torch.no_grad()
    def run(self, layer: DecoderLayer) -> torch.Tensor:
        """The layer's outputs for every sample, in batches (hooks on its modules see each batch), as
        the model's own forward computes them (run_layers: the same rope, YaRN's factors included)."""
        attn = DenseCausalAttention()
        return torch.cat(
            [
                run_layers([layer], x, self.positions[: len(x)], self.inv_freq, attn)
                for x in self.x.split(self.batch_size)
            ]
        )

    def advance(self, layer: DecoderLayer) -> None:
        self.x = self.run(layer)

    def mtp(self) -> "MTPRunner":
        """The runner of the MTP modules, once every decoder layer has advanced this one."""
        with torch.no_grad():
            return MTPRunner(self, self.model.model.final_norm(self.x))


class MTPRunner:
    """Feeds the calibration set through DeepSeek-V3's MTP modules in turn, as CausalLM.mtp_hidden
    does: module k reads the previous depth's normed hidden state (depth 0: the main model's, after
    its final norm) for the rows that have a next token, and the embedding of that token."""

    def __init__(self, main: LayerRunner, hidden: torch.Tensor):
        self.main, self.h = main, hidden  # [samples, rows, H], one row fewer per depth

    @torch.no_grad()
    def run(self, layer: MTPLayer) -> torch.Tensor:
        m, bs, attn = self.main.model, self.main.batch_size, DenseCausalAttention()
        rows, k = self.h.shape[1] - 1, layer.index + 1
        positions, next_ids = self.main.positions[:, :rows], self.main.tokens[:, k:]
        return torch.cat(
            [
                layer(h[:, :rows], ids, positions[: len(h)], attn, m.model.embed, self.main.inv_freq)
                for h, ids in zip(self.h.split(bs), next_ids.split(bs))
            ]
        )

    def advance(self, layer: MTPLayer) -> None:
        with torch.no_grad():
            self.h = layer.norm_output(self.run(layer))


@contextlib.contextmanager
def on_inputs(modules: dict[str, nn.Module], fn: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """Call fn(name, input) on every forward of each module while the block runs."""
    hooks = [m.register_forward_pre_hook(lambda _m, args, name=name: fn(name, args[0])) for name, m in modules.items()]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def collect_inputs(runner: LayerRunner, layer: DecoderLayer, modules: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """Every input row [tokens, in_features] each module sees while the layer runs on the calibration set."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in modules}
    with on_inputs(modules, lambda name, x: seen[name].append(x.reshape(-1, x.shape[-1]).float())):
        runner.run(layer)
    return {n: torch.cat(v) for n, v in seen.items()}
