"""The quality harness every quantization and pruning method is judged by.

Perplexity on the held-out (validation) split of a local corpus with strided windows (each token is
scored once, with up to `window - stride` tokens of context before the scored part, as in the
Hugging Face perplexity recipe), and agreement with a reference model: top-1 agreement of the next-
token argmax on the same windows, and the matched fraction of free-running greedy continuations.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from baton.common.checkpoint import CheckpointError
from baton.common.data import DataConfig, build_datasets
from baton.common.model import CausalLM, greedy_generate
from baton.common.tokenizer import Tokenizer
from baton.serve.quantization.calibration import demo_corpus


@dataclass
class EvalConfig:
    data: DataConfig = field(default_factory=demo_corpus)  # scored on its validation split
    window: int = 128  # tokens per forward
    stride: int = 64  # new tokens scored per window (< window: each window's first token is context)
    max_tokens: int | None = None  # cap the held-out stream (None = all of it)
    batch_size: int = 8
    greedy_prompts: int = 8  # free-running greedy agreement: prompts taken from the held-out stream
    greedy_prompt_len: int = 16
    greedy_new_tokens: int = 32

    def __post_init__(self) -> None:
        if not 0 < self.stride < self.window:
            raise ValueError(f"stride must be in 1..window - 1 ({self.window - 1}), got {self.stride}")
        if self.max_tokens is not None and self.max_tokens < 2:
            raise ValueError(f"max_tokens must be at least 2, got {self.max_tokens}")


@dataclass
class EvalResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token, nats
    num_tokens: int
    top1_agreement: float | None = None  # vs the reference model
    greedy_match: float | None = None
    reference_perplexity: float | None = None

    @property
    def perplexity_delta(self) -> float | None:
        """Relative change against the reference, e.g. 0.01 = +1%."""
        return None if self.reference_perplexity is None else self.perplexity / self.reference_perplexity - 1

    def to_dict(self) -> dict:
        return {**asdict(self), "perplexity_delta": self.perplexity_delta}


def heldout_tokens(cfg: EvalConfig, tokenizer: Tokenizer) -> torch.Tensor:
    """The validation blocks, in corpus order, as one 1-D stream."""
    _, val = build_datasets(cfg.data, tokenizer)
    if len(val) == 0:
        raise ValueError(f"{cfg.data.path or 'the default corpus'} has no validation blocks; raise val_fraction")
    stream = val.with_format("torch")[:]["input_ids"].long().reshape(-1)
    return stream[: cfg.max_tokens] if cfg.max_tokens else stream


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, scored) per window: tokens [end - scored, end) are scored given [begin, end)."""
    out, prev_end = [], 0
    for begin in range(0, n - 1, stride):
        end = min(begin + window, n)
        scored = end - max(prev_end, begin + 1)  # a window's first token has no context in it
        out.append((begin, end, scored))
        prev_end = end
        if end == n:
            break
    return out


@torch.no_grad()
def perplexity(model: CausalLM, tokens: torch.Tensor, cfg: EvalConfig, reference: CausalLM | None = None) -> EvalResult:
    """Strided-window perplexity of `model` on a 1-D token stream; with a reference, also the
    reference's perplexity and the top-1 agreement, from the same windows in the same pass."""
    if cfg.window > model.config.max_position_embeddings:
        raise ValueError(f"window {cfg.window} exceeds the model's context {model.config.max_position_embeddings}")
    device = next(model.parameters()).device
    nll, ref_nll, count, agree = 0.0, 0.0, 0, 0
    spans = windows(tokens.numel(), cfg.window, cfg.stride)
    for i in range(0, len(spans), cfg.batch_size):
        batch = spans[i : i + cfg.batch_size]
        ids = torch.zeros(len(batch), max(e - b for b, e, _ in batch), dtype=torch.long)
        for row, (b, e, _) in enumerate(batch):
            ids[row, : e - b] = tokens[b:e]
        ids = ids.to(device)
        logits = model(ids).float()
        ref = reference(ids).float() if reference is not None else None
        for row, (b, e, scored) in enumerate(batch):
            pos = slice(e - b - scored - 1, e - b - 1)  # logits at pos predict the token after it
            targets = ids[row, pos.start + 1 : pos.stop + 1]
            nll += F.cross_entropy(logits[row, pos], targets, reduction="sum").item()
            count += scored
            if ref is not None:
                ref_nll += F.cross_entropy(ref[row, pos], targets, reduction="sum").item()
                agree += (logits[row, pos].argmax(-1) == ref[row, pos].argmax(-1)).sum().item()
    result = EvalResult(math.exp(nll / count), nll / count, count)
    if reference is not None:
        result.top1_agreement, result.reference_perplexity = agree / count, math.exp(ref_nll / count)
    return result


@torch.no_grad()
def greedy_match(model: CausalLM, reference: CausalLM, tokens: torch.Tensor, cfg: EvalConfig) -> float:
    """Mean fraction of each greedy continuation identical to the reference's before they diverge."""
    device = next(model.parameters()).device
    span = cfg.greedy_prompt_len
    starts = torch.linspace(0, tokens.numel() - span, cfg.greedy_prompts).long().tolist()
    prompts = torch.stack([tokens[s : s + span] for s in starts]).to(device)
    got = greedy_generate(model, prompts, cfg.greedy_new_tokens)
    want = greedy_generate(reference, prompts, cfg.greedy_new_tokens)
    same_prefix = (got == want).long().cumprod(dim=1).sum(dim=1)
    return (same_prefix.float() / cfg.greedy_new_tokens).mean().item()


def evaluate(model: CausalLM, tokens: torch.Tensor, cfg: EvalConfig, reference: CausalLM | None = None) -> EvalResult:
    """Perplexity, plus (with a reference) the reference's perplexity and both agreement measures."""
    result = perplexity(model, tokens, cfg, reference)
    if reference is not None:
        result.greedy_match = greedy_match(model, reference, tokens, cfg)
    return result


def evaluate_checkpoint(path: str | Path, cfg: EvalConfig, reference: str | Path | None = None) -> EvalResult:
    """`baton eval`: load (float or quantized) checkpoints, evaluate on the held-out text."""
    from baton.serve.quantization.loader import load_model

    for p in (path, reference):
        if p is not None and not (Path(p) / "config.json").is_file():
            raise CheckpointError(f"{p} is not a checkpoint directory (no config.json)")
    if not (Path(path) / "tokenizer.json").is_file():
        raise CheckpointError(f"{path} has no tokenizer.json: evaluation tokenizes text with the model's tokenizer")
    model = load_model(path).model.eval()
    ref = load_model(reference).model.eval() if reference is not None else None
    tokens = heldout_tokens(cfg, Tokenizer.from_dir(path))
    return evaluate(model, tokens, cfg, ref)
