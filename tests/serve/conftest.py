"""Small random-weight checkpoints, built through HF transformers and imported like a user would."""

from __future__ import annotations

import pytest
import torch
import transformers

from baton.common.checkpoint import load_checkpoint, save_model
from baton.common.hf import import_hf
from baton.common.tokenizer import train_bpe

BASE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.1,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "mistral": (transformers.MistralConfig, dict(sliding_window=12, head_dim=16)),
    "qwen2": (transformers.Qwen2Config, {}),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
}
TEXT = (
    "The quick brown fox jumps over the lazy dog. " * 20
    + "Émigré naïve café 🦊 😀 日本語のテキスト. " * 10
    + "def f(x):\n    return x * 2\n" * 10
)


def make_hf_checkpoint(tmp_path, family: str, seed: int = 0, **overrides):
    """`overrides`: config fields on top of BASE and the family's (layers, vocab, tied embeddings...).
    Biases (Qwen2's q/k/v, attention_bias) are randomised: HF initialises them to zero."""
    cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cls(**{**BASE, **extra, **overrides})).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    hf.save_pretrained(tmp_path / f"hf-{family}")
    return hf, import_hf(tmp_path / f"hf-{family}", tmp_path / f"baton-{family}")


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    """A Llama checkpoint with a real byte-level BPE tokenizer (vocab 320)."""
    tmp = tmp_path_factory.mktemp("llama")
    _, ckpt = make_hf_checkpoint(tmp, "llama")
    tok = train_bpe([TEXT], vocab_size=BASE["vocab_size"])
    assert tok.vocab_size <= BASE["vocab_size"]
    model = load_checkpoint(ckpt).model
    model.config.eos_token_id = tok.eos_token_id
    save_model(tmp / "with-tok", model, tokenizer=tok)
    return tmp / "with-tok"


def run_staggered(engine, prompts, params, every: int = 3) -> list[list[int]]:
    """Submit one prompt every `every` steps while the others run (continuous batching);
    return each prompt's output token ids."""
    pending, done, step = list(enumerate(prompts)), {}, 0
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params)
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0].token_ids
        step += 1
    return [done[i] for i in range(len(prompts))]


def run_staggered_logprobs(engine, prompts, params, every: int = 2, until: int | None = None) -> dict:
    """run_staggered's schedule, keeping each finished output's (tokens, their logprobs) by prompt
    index; with `until`, stop after that many steps (sequences still running)."""
    pending, done, step = list(enumerate(prompts)), {}, 0
    while (pending or engine.has_unfinished_requests()) and step != until:
        if pending and step % every == 0:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params)
        for out in engine.step():
            if out.finished:
                o = out.outputs[0]
                done[int(out.request_id)] = (o.token_ids, [lp[t] for lp, t in zip(o.logprobs, o.token_ids)])
        step += 1
    return done
