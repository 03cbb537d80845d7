"""KV bytes per token by family at long context: what the engine's block manager holds for one sequence.

Each family is a tiny-width model with the real checkpoint's layer count and layer pattern
(which layers are sliding-window, and the window): Llama-3.1-8B and Qwen3-8B (full attention),
Gemma-3-1B and Gemma-3-4B (five sliding layers to one full, windows 512 and 1024), gpt-oss-20b
(alternating, window 128) and Mistral-7B-v0.1 (every layer sliding, window 4096). One sequence of
`context` tokens is prefilled through LLMEngine (chunks of 2048) and decodes one token; then the
blocks it holds are counted in the block manager, per KV group (serve/scheduling/window_blocks.py),
and priced at the real checkpoint's head layout (kv heads x head_dim, bf16): bytes per block per
group read from the pools of an engine built with that layout. Mixed models run with KV groups on
and off (`kv_cache_groups`); "formula" is the ideal - full layers keep every token, sliding
layers exactly their window: 2 * kv_heads * head_dim * 2 bytes * (full + sliding * min(1, window /
context)).

The forward is skipped (`--forward skip`, the default: the runner returns zero logits for the
rows it would sample), since it cannot change what the block manager holds, and a real forward
over 32k tokens of 32-36 full layers takes minutes here; `--check-real` contexts are run both ways
and must count the same blocks.

Usage: python benchmarks/kv_per_token.py [--contexts 1024 8192 32768] [--check-real 1024]
       [--forward skip|real] [--smoke] [--out DIR]   (writes DIR/kv_per_token.{json,png})
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.runner.model_runner import ExecuteResult
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK, CHUNK = 16, 2048


def gemma3_types(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]


def alternating(n: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


# name: (model_type, layers, kv heads, head_dim, window, layer types)
FAMILIES = {
    "llama (Llama-3.1-8B)": ("llama", 32, 8, 128, None, None),
    "qwen3 (Qwen3-8B)": ("qwen3", 36, 8, 128, None, None),
    "gemma3 5:1 w512 (Gemma-3-1B)": ("gemma3_text", 26, 1, 256, 512, gemma3_types(26)),
    "gemma3 5:1 w1024 (Gemma-3-4B)": ("gemma3_text", 34, 4, 256, 1024, gemma3_types(34)),
    "gpt-oss 1:1 w128 (gpt-oss-20b)": ("gpt_oss", 24, 8, 64, 128, alternating(24)),
    "mistral all-sliding w4096 (Mistral-7B-v0.1)": ("mistral", 32, 8, 128, 4096, None),
}


def model_config(family: tuple, kv_heads: int, head_dim: int, max_len: int) -> ModelConfig:
    model_type, layers, _, _, window, types = family
    extra = {"num_local_experts": 2, "num_experts_per_tok": 1} if model_type == "gpt_oss" else {}
    return ModelConfig(
        model_type=model_type, vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=kv_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max_len, sliding_window=window, layer_types=types, **extra,
    )  # fmt: skip


def engine_for(cfg: ModelConfig, dtype: torch.dtype, num_blocks: int, max_len: int, groups: bool) -> LLMEngine:
    config = EngineConfig(
        num_kv_blocks=num_blocks,
        block_size=BLOCK,
        max_model_len=max_len,
        kv_cache_groups=groups,
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=CHUNK),
    )
    return LLMEngine(build_model(cfg, seed=0).to(dtype).eval(), None, config)


def block_bytes(family: tuple, groups: bool) -> tuple[int, int]:
    """(full layers', sliding layers') bytes of one block, read from the pools of an engine with the
    real head layout in bf16 (with groups off every layer is in the first)."""
    _, _, kv_heads, head_dim, *_ = family
    engine = engine_for(model_config(family, kv_heads, head_dim, 4096), torch.bfloat16, 2, 4096, groups)
    r = engine.runner

    def per_block(layers: list[int]) -> int:
        return sum((k.nbytes + v.nbytes) // k.shape[0] for k, v in (r.kv_caches[i] for i in layers))

    return per_block(r.full_layers), per_block(r.window_layers)


def skip_forward(engine: LLMEngine) -> None:
    """The runner's execute without the model: zero logits for the rows it would sample."""
    runner, vocab = engine.runner, engine.vocab_size

    def execute(scheduled, *flags) -> ExecuteResult:
        plan, groups = runner.plan(scheduled, *flags)
        return ExecuteResult(torch.zeros(len(plan.sample_rows), vocab), groups)

    runner.execute = execute


def held_blocks(family: tuple, context: int, groups: bool, real: bool) -> tuple[int, int, float]:
    """(full-group blocks, sliding-group blocks, seconds) one sequence holds at `context` tokens."""
    cfg = model_config(family, 1, 8, context + 64)
    engine = engine_for(cfg, torch.float32, -(-context // BLOCK) + 2, context + 64, groups)
    if not real:
        skip_forward(engine)
    prompt = torch.randint(0, cfg.vocab_size, (context - 1,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    seq, t = engine.scheduler.waiting[0], time.perf_counter()
    while seq.num_computed_tokens < context:  # the prompt, then one decode step
        engine.step()
    seconds = time.perf_counter() - t
    w = engine.block_manager.window
    full, window = len(seq.block_table), len(w.held(seq)) if w is not None else 0
    engine.abort_request("r")
    bm = engine.block_manager
    assert bm.problem([]) is None and bm.num_free_blocks == bm.num_blocks, "every block is back in the pool"
    return full, window, seconds


def formula(family: tuple, context: int) -> float:
    _, layers, kv_heads, head_dim, window, types = family
    sliding = 0 if window is None else (layers if types is None else types.count("sliding_attention"))
    kept = 1.0 if window is None else min(1.0, window / context)
    return 2 * kv_heads * head_dim * 2 * ((layers - sliding) + sliding * kept)


def measure(name: str, family: tuple, context: int, groups: bool, real: bool) -> dict:
    full, window, seconds = held_blocks(family, context, groups, real)
    bpb_full, bpb_window = block_bytes(family, groups)
    every = (bpb_full + bpb_window) * -(-context // BLOCK) / context  # every layer keeps every token
    measured = (full * bpb_full + window * bpb_window) / context
    return {
        "family": name, "context": context, "kv_groups": groups, "forward": "real" if real else "skip",
        "full_blocks": full, "sliding_blocks": window, "block_bytes_full": bpb_full,
        "block_bytes_sliding": bpb_window, "bytes_per_token": measured,
        "formula_bytes_per_token": formula(family, context), "every_token_bytes_per_token": every,
        "vs_every_token": measured / every, "seconds": seconds,
    }  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    on = [r for r in rows if r["kv_groups"] and r["forward"] == "skip"]
    names = list(dict.fromkeys(r["family"] for r in on))
    contexts = sorted({r["context"] for r in on})
    fig, (ax, share) = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    width = 0.8 / len(contexts)
    for j, c in enumerate(contexts):
        xs = [i + (j - (len(contexts) - 1) / 2) * width for i in range(len(names))]
        by = {r["family"]: r for r in on if r["context"] == c}
        ax.bar(xs, [by[n]["bytes_per_token"] / 1024 for n in names], width, label=f"{c} tokens")
        ax.scatter(xs, [by[n]["formula_bytes_per_token"] / 1024 for n in names], marker="_", color="k", s=120)
        share.bar(xs, [by[n]["vs_every_token"] for n in names], width, label=f"{c} tokens")
    share.set_xticks(range(len(names)), [n.replace(" (", "\n(") for n in names], fontsize=8)
    ax.set_ylabel("KV KiB per token (bf16; -: formula)")
    share.set_ylabel("share of every layer keeping every token")
    ax.set_title("KV bytes per token held by one sequence, by family and context (KV groups on)")
    for a in (ax, share):
        a.grid(axis="y", alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--check-real", type=int, nargs="*", default=[1024], help="contexts also run with the real forward")
    ap.add_argument("--forward", choices=("skip", "real"), default="skip")
    ap.add_argument("--smoke", action="store_true", help="short contexts (the windows stay real)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.smoke:
        args.contexts, args.check_real = [160, 600], [160]
    torch.set_num_threads(1)
    rows = []
    print(f"{'family':<44} {'context':>7} {'groups':>6} {'full':>5} {'slid':>5} {'KiB/tok':>8} {'formula':>8} "
          f"{'vs all':>6} {'s':>6}")  # fmt: skip
    for name, family in FAMILIES.items():
        mixed = family[5] is not None and "full_attention" in family[5]
        for context in args.contexts:
            runs = [(g, args.forward == "real") for g in ((True, False) if mixed else (True,))]
            if args.forward == "skip" and context in args.check_real:
                runs += [(g, True) for g, _ in runs]
            for groups, real in runs:
                r = measure(name, family, context, groups, real)
                rows.append(r)
                print(
                    f"{name:<44} {context:>7} {('on' if groups else 'off') if mixed else '-':>6} {r['full_blocks']:>5} "
                    f"{r['sliding_blocks']:>5} {r['bytes_per_token'] / 1024:>8.2f} "
                    f"{r['formula_bytes_per_token'] / 1024:>8.2f} {r['vs_every_token']:>6.3f} {r['seconds']:>6.1f}"
                    + ("  (real forward)" if real else "")
                )
    key = lambda r: (r["family"], r["context"], r["kv_groups"])  # noqa: E731
    skipped = {key(r): r for r in rows if r["forward"] == "skip"}
    for r in rows:  # the real forward holds exactly what the skipped one does
        if r["forward"] == "real" and key(r) in skipped:
            twin = skipped[key(r)]
            assert (twin["full_blocks"], twin["sliding_blocks"]) == (r["full_blocks"], r["sliding_blocks"]), r
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"block_size": BLOCK, "chunk": CHUNK, "dtype": "bfloat16", "rows": rows}
    (args.out / "kv_per_token.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, args.out / "kv_per_token.png")


if __name__ == "__main__":
    main()
