"""Early exit rows of benchmarks/speculative.py: LayerSkip self-speculation and CALM confidence exit.

Both need a model trained to exit early, so they run on a LayerSkip-trained copy of the benchmark's
target (fine-tuned from it with an early_exit: section, exits after layers 2..L-2, cached beside
it) against that copy's own plain decoding, in the same run and on the same prompts as the other
modes. CALM is not exact, so its rows also carry quality: agreement (share of generated tokens
equal to full-depth greedy decoding's at the same position, same prompts) and perplexity on
held-out text, teacher-forced through the engine's runner with the same exit rule and KV fill
(`ppl`; full depth: the plain row's). The share of tokens leaving at each exit is `exit_share`.

Run through benchmarks/speculative.py (its table, JSON and plot); `python benchmarks/early_exit.py
--target DIR` prints the quality sweep alone for any checkpoint with recorded exits.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from baton.serve.core.sequence import Sequence
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.sampling_params import SamplingParams
from baton.serve.speculative import SpeculativeConfig

THRESHOLDS = (0.95, 0.8, 0.6)


def layerskip_target(target: Path, out: Path, steps: int, corpus: str | None) -> Path:
    """A LayerSkip fine-tune of `target` (cached under out/handoff)."""
    handoff = out / "handoff"
    if (handoff / "config.json").is_file():
        return handoff
    from baton.common.checkpoint import read_config
    from baton.train.recipe import config_from_dict
    from baton.train.trainer import train

    layers = read_config(target).num_hidden_layers
    exits = list(range(2, max(3, layers - 1)))
    train(
        config_from_dict(
            {
                "init_from": str(target),
                "data": {"path": corpus, "seq_len": 128, "val_fraction": 0.05},
                "early_exit": {"exit_layers": exits, "loss_scale": 1.0, "layer_dropout": 0.1},
                "micro_batch_size": 12,
                "max_steps": steps,
                "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": min(20, steps)},
                "eval_interval": 0,
                "logging": {"progress": False, "mfu": False, "plot": False, "tensorboard": False},
                "out_dir": str(out),
            }
        )
    )
    return handoff


def smoke_target(target: Path, out: Path) -> Path:
    """--smoke: the smoke target's tokenizer on a random 4-layer model recording exits 2 and 3."""
    import dataclasses

    from baton.common.checkpoint import read_config, save_model
    from baton.common.model import build_model
    from baton.common.tokenizer import Tokenizer

    cfg = dataclasses.replace(read_config(target), num_hidden_layers=4, early_exit_layers=[2, 3])
    save_model(out, build_model(cfg, seed=2), tokenizer=Tokenizer.from_dir(target))
    return out


def modes(target: Path) -> dict[str, SpeculativeConfig | dict | None]:
    """plain, LayerSkip from the first and the middle exit, CALM at each threshold (a dict: EngineConfig fields)."""
    from baton.common.checkpoint import read_config

    exits = read_config(target).early_exit_layers
    mid = exits[len(exits) // 2]
    out: dict = {
        "plain (layerskip-trained)": None,
        **{
            f"layerskip E={e} k=4": SpeculativeConfig("layerskip", 4, exit_layer=e)
            for e in dict.fromkeys([exits[0], mid])
        },
    }
    out.update({f"calm t={t}": {"early_exit_threshold": t} for t in THRESHOLDS})
    return out


def greedy(target: Path, prompts: list[str], max_tokens: int, threshold: float | None) -> tuple[list, dict]:
    """Every prompt's greedy tokens (one batch), and the tokens counted per exit (CALM)."""
    engine = LLMEngine.from_checkpoint(target, EngineConfig(num_kv_blocks=2048, early_exit_threshold=threshold))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({int(o.request_id): o.outputs[0].token_ids for o in engine.step() if o.finished})
    counts = dict(engine.early_exit.exits) if engine.early_exit is not None else {}
    return [done[i] for i in range(len(prompts))], counts


@torch.no_grad()
def perplexity(target: Path, token_ids: list[int], threshold: float | None) -> float:
    """exp(mean NLL) of token_ids, one position per step through the engine's runner: each token is
    fed as a generated one, so with a threshold it may exit (and its skipped K/V are filled)."""
    engine = LLMEngine.from_checkpoint(target, EngineConfig(num_kv_blocks=2048, early_exit_threshold=threshold))
    seq = Sequence(0, "ppl", 0, token_ids[:1], SamplingParams(temperature=0))
    nll = 0.0
    for i in range(len(token_ids) - 1):
        if i:
            seq.token_ids.append(token_ids[i])
        engine.block_manager.allocate_slots(seq, 1)
        logits = engine.runner.execute([(seq, 1)]).logits[0].float()
        seq.num_computed_tokens += 1
        nll -= float(torch.log_softmax(logits, -1)[token_ids[i + 1]])
    engine.block_manager.free(seq)
    return math.exp(nll / (len(token_ids) - 1))


def quality(target: Path, prompts: list[str], max_tokens: int, heldout: list[int]) -> dict[str, dict]:
    """{mode: agreement, ppl, exit_share} for full depth and each CALM threshold."""
    from baton.common.checkpoint import read_config

    layers = read_config(target).num_hidden_layers
    full, _ = greedy(target, prompts, max_tokens, None)
    out = {"plain (layerskip-trained)": {"agreement": 1.0, "ppl": perplexity(target, heldout, None)}}
    for t in THRESHOLDS:
        got, counts = greedy(target, prompts, max_tokens, t)
        same = sum(a == b for g, f in zip(got, full) for a, b in zip(g, f))
        total = sum(counts.values())
        out[f"calm t={t}"] = {
            "agreement": same / sum(len(f) for f in full),
            "ppl": perplexity(target, heldout, t),
            "exit_share": {str(e): counts.get(e, 0) / total for e in sorted(counts) if e < layers},
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", type=Path, required=True, help="a checkpoint with recorded exits")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    from baton.common.corpus import default_corpus_text
    from baton.common.tokenizer import Tokenizer

    text = default_corpus_text()
    prompts = [text[i : i + 48] for i in range(0, 8 * 997, 997)]
    heldout = Tokenizer.from_dir(args.target).encode(text[-2000:])[:400]
    for mode, q in quality(args.target, prompts, args.max_tokens, heldout).items():
        print(f"{mode:<28} agreement {q['agreement']:.0%}  ppl {q['ppl']:.3f}  exits {q.get('exit_share', {})}")


if __name__ == "__main__":
    main()
