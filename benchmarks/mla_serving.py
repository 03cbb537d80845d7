"""MLA's latent-only cache in the serving engine: KV bytes, batch capacity, and decode cost absorbed vs naive.

1. KV bytes per token and the largest batch a fixed KV budget holds, MLA against attention of equal
   parameters: twins with the MLA model's hidden size, layers and MLP/MoE (so only attention differs),
   head_dim = qk_nope_head_dim (128 for DeepSeek-V3) and the head counts whose attention parameters
   (q, k, v, o) come closest to the MLA layer's (q_a, q_b, kv_a, kv_b, o and the two norms). GQA: 8 KV
   heads (Llama-3 8B/70B/405B's and Qwen3's choice) and the query heads, a multiple of 8, that match
   within 5% (else 4, 2, 1 KV heads); MHA: one KV head per query head (DeepSeek-V2's dense baseline).
   The sizes come from the engine's own code: kv_block_bytes (the pools' layout) and plan_pools over
   the budget, for DeepSeek-V3's real shapes (61 layers, 7168 hidden, kv_lora_rank 512, qk_rope 64;
   models on the meta device, nothing allocated) and for the small model below, where an engine with
   that budget then really admits the sequences: the most it keeps running at once is counted (its
   forward skipped: capacity is blocks).
2. Decode ms/token through LLMEngine.step() for a small DeepSeek-shaped model (DeepSeek-V3's head
   shapes - kv_lora_rank 512, qk_rope 64, qk_nope 128, v 128 - with 8 heads, q_lora 384, hidden 1024,
   2 layers), absorbed (the latent backend, serve/runner/mla_attention.py) against the naive form
   (the same engine with the blocks each step reads decompressed by kv_b_proj), at contexts 1k-16k.
   The prompts' prefill is skipped (the runner's forward replaced by zero logits until the first
   token: the cache rows are then zeros, which costs a decode exactly what real latents cost), then
   the decode steps run the real forward.
3. One prefill chunk of N tokens after a P-token prefix through the runner's forward, every row
   absorbed against decompressed prefill (what sets mla_attention.DECOMPRESS_FROM, the chunk length
   from which the backend attends chunks decompressed).

Usage: python benchmarks/mla_serving.py [--contexts 1024 2048 4096 8192 16384] [--batch 1 4]
       [--clock wall|thread] [--smoke] [--out DIR]   (writes DIR/mla_serving.{json,png})
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from baton.common.config import ModelConfig
from baton.common.model import CausalLM, build_model
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.engine.sizing import plan_pools
from baton.serve.runner.model_runner import ExecuteResult, kv_block_bytes
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 16
V3 = dict(  # DeepSeek-V3's attention and widths (the MoE is the same in both twins, so left dense here)
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61, num_attention_heads=128,
    kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
)  # fmt: skip
SMALL = dict(
    vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
    kv_lora_rank=512, q_lora_rank=384, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
)  # fmt: skip


def mla_config(shape: dict, max_len: int) -> ModelConfig:
    n = shape["num_hidden_layers"]
    return ModelConfig(model_type="deepseek_v3", first_k_dense_replace=n, max_position_embeddings=max_len, **shape)


def attention_parameters(cfg: ModelConfig) -> int:
    """One layer's attention parameters (the rest of the model is shared by the twins)."""
    h = cfg.hidden_size
    if cfg.is_mla:
        heads, lr, r = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        qk = cfg.qk_nope_head_dim + r
        q = h * heads * qk if cfg.q_lora_rank is None else cfg.q_lora_rank * (h + 1 + heads * qk)
        return q + h * (lr + r) + lr + lr * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) + heads * cfg.v_head_dim * h
    d = cfg.head_dim
    return 2 * h * cfg.num_attention_heads * d + 2 * h * cfg.num_key_value_heads * d


def twin(mla: ModelConfig, kv_heads: int | None) -> tuple[ModelConfig, float]:
    """The attention config of the same hidden size, layers and MLP whose attention parameters (q, k,
    v, o) come closest to the MLA layer's: (config, its parameters' relative difference). kv_heads None: MHA (as
    many KV heads as query heads, DeepSeek-V2's dense baseline); else GQA with that many KV heads and
    the query heads (a multiple of them, at least twice as many) that match best."""
    want, h, head_dim, best = attention_parameters(mla), mla.hidden_size, mla.qk_nope_head_dim, None
    for hq in range(1, max(4 * mla.num_attention_heads, 16) + 1):
        kv = hq if kv_heads is None else kv_heads
        if kv_heads is not None and (hq % kv or hq < 2 * kv):
            continue
        gap = (2 * h * (hq + kv) * head_dim - want) / want
        if best is None or abs(gap) < abs(best[0]):
            best = (gap, hq, kv)
    gap, hq, kv = best
    shape = dict(
        vocab_size=mla.vocab_size, hidden_size=h, intermediate_size=mla.intermediate_size,
        num_hidden_layers=mla.num_hidden_layers, num_attention_heads=hq, num_key_value_heads=kv, head_dim=head_dim,
        max_position_embeddings=mla.max_position_embeddings,
    )  # fmt: skip
    return ModelConfig(model_type="llama", **shape), gap


def gqa_twin(mla: ModelConfig) -> tuple[ModelConfig, float]:
    """GQA of equal attention parameters: Llama-3's 8 KV heads of 128 where the query heads can then
    match the parameters within 5% (Llama-3 8B/70B/405B and Qwen3 all keep 8), else 4, 2, 1."""
    for kv in (8, 4, 2, 1):
        cfg, gap = twin(mla, kv)
        if abs(gap) <= 0.05:
            return cfg, gap
    return cfg, gap


def capacity(cfg: ModelConfig, budget: int, contexts: list[int]) -> dict:
    """Bytes per token and sequences per budget from the engine's sizing, on a meta-device model."""
    with torch.device("meta"):
        model = CausalLM(cfg).to(torch.bfloat16)
    block = kv_block_bytes(model, BLOCK, torch.bfloat16)
    pools = plan_pools(EngineConfig(block_size=BLOCK, kv_cache_bytes=budget), cfg, block, torch.bfloat16, "cpu")
    return {
        "bytes_per_token": block // BLOCK,
        "blocks": pools.num_blocks,
        "max_batch": {c: pools.num_blocks // -(-c // BLOCK) for c in contexts},
    }


def skip_forward(engine: LLMEngine) -> callable:
    """Replace the runner's execute by zero logits for the rows it would sample; returns the real one."""
    runner, real = engine.runner, engine.runner.execute

    def execute(scheduled, *flags) -> ExecuteResult:
        plan, groups = runner.plan(scheduled, *flags)
        return ExecuteResult(torch.zeros(len(plan.sample_rows), engine.vocab_size), groups)

    runner.execute = execute
    return real


def admitted(cfg: ModelConfig, budget: int, context: int) -> int:
    """The most sequences of `context` tokens an engine with `budget` KV bytes keeps running at once."""
    engine = LLMEngine(
        build_model(cfg, seed=0).to(torch.bfloat16).eval(), None,
        EngineConfig(block_size=BLOCK, kv_cache_bytes=budget, enable_prefix_caching=False,
                     scheduler=SchedulerConfig(max_num_seqs=4096, max_num_batched_tokens=1 << 22)),
    )  # fmt: skip
    skip_forward(engine)
    n = engine.block_manager.num_blocks // -(-context // BLOCK) + 4
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        prompt = torch.randint(0, cfg.vocab_size, (context - 1,), generator=g).tolist()
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, len(engine.scheduler.running))
    return most


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
clock = time.perf_counter


def decode_ms(model_cfg: ModelConfig, form: str, context: int, batch: int, steps: int, dtype) -> float:
    """Median ms per decode step of `batch` sequences at `context` tokens (prefill skipped)."""
    model = build_model(model_cfg, seed=0).to(dtype).eval()
    engine = LLMEngine(
        model, None,
        EngineConfig(num_kv_blocks=batch * (-(-(context + steps + 2) // BLOCK)) + 1, block_size=BLOCK,
                     enable_prefix_caching=False, max_model_len=context + steps + 4,
                     scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=4096)),
    )  # fmt: skip
    engine.runner.attn.form = form
    real = skip_forward(engine)
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        prompt = torch.randint(0, model_cfg.vocab_size, (context,), generator=g).tolist()
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    seqs = list(engine.scheduler.waiting)
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    engine.runner.execute = real
    times = []
    for _ in range(steps):
        t = clock()
        engine.step()
        times.append(clock() - t)
    return sorted(times)[len(times) // 2] * 1e3


def prefill_ms(model_cfg: ModelConfig, form: str, prefix: int, chunk: int, dtype, repeats: int = 3) -> float:
    """Best ms of the runner's forward over one chunk of `chunk` tokens after a cached `prefix`, every
    row absorbed ("absorbed": no chunk decompressed) or the chunk decompressed ("decompress")."""
    from baton.serve.runner import mla_attention
    from baton.serve.runner.step_plan import Chunk, StepPlan

    model = build_model(model_cfg, seed=0).to(dtype).eval()
    n = -(-(prefix + chunk) // BLOCK)
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=n + 1, block_size=BLOCK, enable_prefix_caching=False))
    runner = engine.runner
    runner.attn.form = form
    tokens = torch.randint(0, model_cfg.vocab_size, (chunk,), generator=torch.Generator().manual_seed(0)).tolist()
    plan = StepPlan.from_chunks([Chunk(0, prefix, 0, tokens, list(range(n)), None, "last")], BLOCK)
    best, threshold = math.inf, mla_attention.DECOMPRESS_FROM
    mla_attention.DECOMPRESS_FROM = 1 << 62  # (the absorbed form for every chunk; "decompress" ignores it)
    try:
        for _ in range(repeats):
            t = clock()
            runner.forward(plan)
            best = min(best, clock() - t)
    finally:
        mla_attention.DECOMPRESS_FROM = threshold
    return best * 1e3


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cap, dec) = plt.subplots(1, 2, figsize=(13, 4.8))
    v3 = result["capacity"]["deepseek_v3"]
    contexts = sorted(int(c) for c in v3["mla"]["max_batch"])
    for kind in ("mla", "gqa", "mha"):
        row = v3[kind]
        name = (
            "MLA (latent cache)" if kind == "mla" else f"{kind.upper()} {row['heads']} q / {row['kv_heads']} KV heads"
        )
        fits = [c for c in contexts if row["max_batch"][c] > 0]  # (a log axis: where one sequence fits)
        cap.plot(
            fits, [row["max_batch"][c] for c in fits], marker="o", label=f"{name}, {row['bytes_per_token']:,} B/token"
        )
    cap.set_xscale("log", base=2)
    cap.set_yscale("log")
    cap.set_xlabel("context (tokens)")
    cap.set_ylabel("sequences per KV budget")
    cap.set_title(f"DeepSeek-V3 shapes, {result['budget_bytes'] / 2**30:.0f} GiB KV (bf16)")
    for form in ("absorbed", "decompress"):
        for b in sorted({r["batch"] for r in result["decode"]}):
            rows = [r for r in result["decode"] if r["form"] == form and r["batch"] == b]
            dec.plot(
                [r["context"] for r in rows], [r["ms_per_token"] for r in rows], marker="o", label=f"{form}, batch {b}"
            )
    dec.set_xscale("log", base=2)
    dec.set_yscale("log")
    dec.set_xlabel("context (tokens)")
    dec.set_ylabel("decode ms per token")
    dec.set_title(f"small DeepSeek-shaped model, engine decode on CPU ({result['clock']} clock)")
    for a in (cap, dec):
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="thread: CPU seconds of one thread, torch on one thread (steady on a shared host)",
    )
    ap.add_argument("--smoke", action="store_true", help="a tiny model, short contexts")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    if args.clock == "thread":
        torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    small = dict(SMALL)
    if args.smoke:
        args.contexts, args.batch, args.steps = [64, 128], [1], 2
        small.update(hidden_size=64, intermediate_size=64, num_attention_heads=2, kv_lora_rank=32, q_lora_rank=16,
                     qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, vocab_size=128)  # fmt: skip
    budget = 8 * 2**30
    max_len = max(args.contexts) + 64
    result = {"budget_bytes": budget, "block_size": BLOCK, "dtype": args.dtype, "capacity": {}, "decode": [],
              "prefill": [], "threads": torch.get_num_threads(), "clock": args.clock}  # fmt: skip

    print(f"KV budget {budget / 2**30:.0f} GiB (bf16), block {BLOCK}")
    print(f"{'model':<14} {'attn':<5} {'heads q/kv':>10} {'attn params':>12} {'KV B/token':>11}  sequences at "
          + " ".join(f"{c:>6}" for c in args.contexts))  # fmt: skip
    for name, shape in (("deepseek_v3", V3), ("small", small)):
        mla = mla_config(shape, max_len)
        (gqa, gap), (mha, mha_gap) = gqa_twin(mla), twin(mla, None)
        rows = {}
        for kind, cfg in (("mla", mla), ("gqa", gqa), ("mha", mha)):
            row = capacity(cfg, budget if name == "deepseek_v3" else budget // 256, args.contexts)
            row.update(attention_parameters=attention_parameters(cfg), heads=cfg.num_attention_heads,
                       kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)  # fmt: skip
            rows[kind] = row
            heads = f"{cfg.num_attention_heads}/{'latent' if kind == 'mla' else cfg.num_key_value_heads}"
            print(f"{name:<14} {kind:<5} {heads:>10} {row['attention_parameters']:>12,} {row['bytes_per_token']:>11,}  "
                  + " " * 13 + " ".join(f"{row['max_batch'][c]:>6}" for c in args.contexts))  # fmt: skip
        rows["parameter_gap"], rows["mha_parameter_gap"] = gap, mha_gap
        rows["kv_ratio"] = rows["gqa"]["bytes_per_token"] / rows["mla"]["bytes_per_token"]
        rows["mha_kv_ratio"] = rows["mha"]["bytes_per_token"] / rows["mla"]["bytes_per_token"]
        if name == "small":  # the engine really admits that many at the shortest context
            c = args.contexts[0]
            for kind, cfg in (("mla", mla), ("gqa", gqa)):
                rows[kind]["admitted"] = {c: admitted(cfg, budget // 256, c)}
                print(
                    f"  {kind}: the engine kept {rows[kind]['admitted'][c]} sequences of {c} tokens running "
                    f"(sizing says {rows[kind]['max_batch'][c]})"
                )
        print(f"  attention parameters vs MLA's: GQA {gap:+.1%}, MHA {mha_gap:+.1%}; KV per token: GQA "
              f"{rows['kv_ratio']:.1f}x MLA's, MHA {rows['mha_kv_ratio']:.1f}x")  # fmt: skip
        result["capacity"][name] = rows

    cfg = mla_config(small, max_len)
    print(f"\ndecode ms/token, {args.dtype}, {torch.get_num_threads()} threads")
    print(f"{'context':>8} {'batch':>5} {'absorbed':>9} {'naive':>9} {'naive/absorbed':>15}")
    for c in args.contexts:
        for b in args.batch:
            if b * c > 16384:  # (the naive form's decompression grows with batch x context: keep it under minutes)
                continue
            ms = {form: decode_ms(cfg, form, c, b, args.steps, dtype) for form in ("absorbed", "decompress")}
            for form, t in ms.items():
                result["decode"].append(
                    {"context": c, "batch": b, "form": form, "ms_per_step": t, "ms_per_token": t / b}
                )
            print(f"{c:>8} {b:>5} {ms['absorbed'] / b:>9.2f} {ms['decompress'] / b:>9.2f} "
                  f"{ms['decompress'] / ms['absorbed']:>15.2f}")  # fmt: skip

    print("\nprefill chunk ms (runner forward), absorbed vs decompressed")
    chunks = [(0, 64), (0, 256), (2048, 128), (2048, 256), (2048, 512), (8192, 512)]
    chunks = chunks if not args.smoke else [(0, 32), (32, 32)]
    for prefix, chunk in chunks:
        ms = {form: prefill_ms(cfg, form, prefix, chunk, dtype) for form in ("absorbed", "decompress")}
        result["prefill"].append({"prefix": prefix, "chunk": chunk, **{f"{k}_ms": v for k, v in ms.items()}})
        print(
            f"  prefix {prefix:>5} chunk {chunk:>4}: absorbed {ms['absorbed']:8.1f}  decompress {ms['decompress']:8.1f}"
        )

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mla_serving.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "mla_serving.png")


if __name__ == "__main__":
    main()
