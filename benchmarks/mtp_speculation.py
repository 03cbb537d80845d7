"""DeepSeek-V3's MTP module as a draft (`--speculative mtp`): acceptance and batch-1 decode speed-up.

Trains (once, cached under benchmarks/results/spec-models/mtp-steps{N}/) a small DeepSeek-V3-shaped
char model on TinyShakespeare (or the embedded corpus) together with its one MTP module, DeepSeek-V3's
way: the main next-token loss plus lambda = 0.3 times the MTP module's loss (it predicts the token
after next from the main model's final hidden state and the next token's embedding), the routers'
bias moved by the sign of each expert's load error every step (loss-free balancing, rate 1e-3). The
MTP rows of each batch start at a random position, since the served module only attends from a
prompt's last token on (the engine hands over hidden states from there). Then the same 8 natural
prompts are decoded at batch 1 (one prompt at a time) plainly and with `--speculative mtp` at k = 1,
2, 3, every mode 3 times interleaved, the median reported: tokens/s (decode steps only), speed-up
over plain, the part of a step spent drafting (the MTP passes), acceptance (accepted / proposed),
mean accepted length (tokens per verification pass) and acceptance per depth. Greedy, where every
mode's tokens are asserted equal to plain decoding's, and sampled at temperature 0.8 (a seed per
prompt; speculative sampling keeps the target's distribution, tests/serve/test_mtp_speculative.py),
since a small char model's greedy text loops ("the some the some") and flatters any drafter.

The target here has 3 layers and the MTP module is a whole MLA + MoE layer plus its own norms,
projection and LM-head pass, run as plain torch modules: one draft pass costs half to a whole
target step on this CPU (the draft ms column), where DeepSeek-V3's module is one layer against 61;
and a verification forward of k + 1 rows costs more than a one-row decode step. Read the speed-up
with that, and the acceptance as the part that carries over.

Usage: python benchmarks/mtp_speculation.py [--steps 600] [--repeats 3]
         (writes benchmarks/results/mtp_speculation.{json,png})
       python benchmarks/mtp_speculation.py --target DIR   (a handoff with MTP weights, e.g. after
         `baton train configs/deepseek-v3-tiny.yaml`; prompts from the embedded default corpus)
       python benchmarks/mtp_speculation.py --smoke   (a few training steps, short decodes: that it runs)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.sampling_params import SamplingParams
from baton.serve.speculative import SpeculativeConfig

RESULTS = Path(__file__).resolve().parent / "results"
SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"

# DeepSeek-V3's layout at CPU size: MLA with a low-rank query, a dense first layer, then DeepSeekMoE
# (8 routed experts in 2 groups, top-2 from the best group, one shared expert), one MTP module.
MODEL = dict(
    model_type="deepseek_v3",
    hidden_size=96,
    intermediate_size=192,
    moe_intermediate_size=48,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=512,
    num_nextn_predict_layers=1,
)
SEQ, BATCH, LR, MTP_WEIGHT, BIAS_RATE = 64, 12, 3e-3, 0.3, 1e-3
SAMPLED = 0.8  # the sampled rows' temperature (a seed per prompt): greedy char models fall into loops


def train_model(out: Path, text: str, steps: int) -> dict:
    """Main model and MTP module trained jointly from scratch; returns what the table states."""
    from baton.common.checkpoint import save_model
    from baton.common.config import ModelConfig
    from baton.common.deepseek_moe import DeepSeekMoE
    from baton.common.model import build_model
    from baton.common.tokenizer import train_char

    tok = train_char(text)
    data = torch.tensor(tok.encode(text))
    model = build_model(ModelConfig(**MODEL, vocab_size=tok.vocab_size), seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, LR, total_steps=steps, pct_start=0.1)
    g = torch.Generator().manual_seed(0)
    moes = [m for m in model.modules() if isinstance(m, DeepSeekMoE)]
    t0 = time.perf_counter()
    for step in range(steps):
        idx = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=g)
        x = torch.stack([data[i : i + SEQ + 1] for i in idx])
        ids = x[:, :-1]
        hidden = model.hidden(ids)
        main = F.cross_entropy(model.compute_logits(hidden).flatten(0, 1), x[:, 1:].flatten())
        s = int(torch.randint(0, SEQ // 2, (), generator=g))  # the MTP rows from a random "prompt end"
        positions = torch.arange(s, SEQ).expand(BATCH, -1)
        (logits,) = model.mtp_logits(ids[:, s:], hidden[:, s:], positions)  # row i: token s + i + 2
        mtp = F.cross_entropy(logits.flatten(0, 1), x[:, s + 2 :].flatten())
        opt.zero_grad()
        (main + MTP_WEIGHT * mtp).backward()
        opt.step()
        sched.step()
        for m in moes:
            m.update_bias(BIAS_RATE)
        if step % 50 == 0 or step == steps - 1:
            print(f"  step {step:>4}  loss {main.item():.3f}  mtp loss {mtp.item():.3f}", flush=True)
    save_model(out, model.eval(), tokenizer=tok)
    info = {"steps": steps, "seconds": time.perf_counter() - t0, "loss": main.item(), "mtp_loss": mtp.item()}
    (out / "training.json").write_text(json.dumps(info, indent=2))
    return info


def run(target: Path, spec: SpeculativeConfig | None, prompts: list[str], max_tokens: int, temperature: float) -> dict:
    """Each prompt alone to completion (batch 1); only the decode steps are timed."""
    engine = LLMEngine.from_checkpoint(target, EngineConfig(num_kv_blocks=512, block_size=16, speculative=spec))
    wall, tokens, steps, outputs = 0.0, 0, 0, {}
    drafting = [0.0]  # seconds in the proposer (the MTP passes): the rest of a step is the target's
    if engine.speculative is not None:
        propose = engine.speculative.proposer.propose

        def timed(seqs, ks):
            t = time.perf_counter()
            propose(seqs, ks)
            drafting[0] += time.perf_counter() - t

        engine.speculative.proposer.propose = timed
    for i, p in enumerate(prompts):
        engine.add_request(
            str(i), p, SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens, ignore_eos=True)
        )
        engine.step()  # the prefill, outside the timed region
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            steps += 1
            for out in engine.step():
                if out.finished:
                    outputs[i] = list(out.outputs[0].token_ids)
                    tokens += len(out.outputs[0].token_ids)
        wall += time.perf_counter() - t
    s = engine.speculative.stats if engine.speculative is not None else None
    return {
        "tokens_per_s": tokens / wall,
        "ms_per_step": 1e3 * wall / steps,
        "draft_ms_per_step": 1e3 * drafting[0] / steps,
        "outputs": outputs,
        "acceptance_rate": s.acceptance_rate if s else 0.0,
        "mean_accepted_length": s.mean_accepted_length if s else 1.0,
        "acceptance_by_depth": s.acceptance_by_depth if s else [],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600, help="training steps (main model and MTP module together)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode, interleaved; the median is reported")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--target", type=Path, help="measure this handoff (it must carry MTP weights) instead")
    ap.add_argument("--smoke", action="store_true", help="a few training steps and short decodes")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a small shared machine other jobs deschedule OpenMP workers and every "
        "parallel region waits for them; the decode of a model this small gains little from more)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.smoke:
        args.steps, args.repeats, args.max_tokens = 4, 1, 8
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    training = None
    if args.target is not None:
        from baton.common.corpus import default_corpus_text

        target, text = args.target, default_corpus_text()
    else:
        text = SHAKESPEARE.read_text() if SHAKESPEARE.is_file() else None
        if text is None:
            from baton.common.corpus import default_corpus_text

            text = default_corpus_text()
        target = args.out / "spec-models" / f"mtp-steps{args.steps}"  # (git-ignored, as speculative.py's models)
        if not (target / "config.json").is_file():
            print(f"training the DeepSeek-V3-shaped model and its MTP module ({args.steps} steps) into {target}")
            train_model(target, text, args.steps)
        training = json.loads((target / "training.json").read_text())
    rng = random.Random(0)
    prompts = [text[i : i + 48] for i in (rng.randrange(len(text) - 100) for _ in range(2 if args.smoke else 8))]
    modes = {"plain": None, **{f"mtp k={k}": SpeculativeConfig("mtp", k) for k in (1, 2, 3)}}
    rows = []
    for temperature in (0.0, SAMPLED):
        seen: dict[str, list[dict]] = {m: [] for m in modes}
        for _ in range(args.repeats):
            for name, spec in modes.items():
                seen[name].append(run(target, spec, prompts, args.max_tokens, temperature))
        want = seen["plain"][0]["outputs"]
        for name, rs in seen.items():  # greedy: every run's tokens are plain decoding's (sampled: other draws)
            assert all(r.pop("outputs") == want for r in rs) or temperature > 0, f"{name} is not plain decoding"
        median = {name: sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2] for name, rs in seen.items()}
        base = median["plain"]["tokens_per_s"]
        for name, r in median.items():
            rows.append({"mode": name, "temperature": temperature, **r, "speedup": r["tokens_per_s"] / base})
    commit = subprocess.run(
        ["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = {
        "commit": commit,
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),  # (a shared machine: what else ran, 1/5/15-minute averages)
        "model": {k: v for k, v in MODEL.items() if k != "model_type"},
        "training": training,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "rows": rows,
    }
    (args.out / "mtp_speculation.json").write_text(json.dumps(result, indent=2))
    head = f"{'temp':<6}{'mode':<10}{'tok/s':>8}{'ms/step':>9}{'draft ms':>9}{'speedup':>9}{'accept':>8}{'mean len':>9}"
    print(f"\n{head}  accept by depth")
    for r in result["rows"]:
        depths = " ".join(f"{a:.0%}" for a in r["acceptance_by_depth"])
        print(
            f"{r['temperature']:<6}{r['mode']:<10}{r['tokens_per_s']:>8.1f}{r['ms_per_step']:>9.2f}{r['draft_ms_per_step']:>9.2f}{r['speedup']:>8.2f}x"
            f"{r['acceptance_rate']:>8.0%}{r['mean_accepted_length']:>9.2f}  {depths}"
        )
    plot(result, args.out / "mtp_speculation.png")


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = r["rows"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
    label = lambda x: f"{x['mode']}\n{'greedy' if x['temperature'] == 0 else 'T=' + str(x['temperature'])}"  # noqa: E731
    ax[0].bar(
        [label(x) for x in rows],
        [x["speedup"] for x in rows],
        color=["C0" if x["temperature"] == 0 else "C1" for x in rows],
    )
    ax[0].axhline(1.0, c="gray", ls="--")
    ax[0].tick_params(axis="x", labelsize=7)
    ax[0].set(ylabel="decode tokens/s over plain", title="batch-1 speed-up (CPU)")
    for x in rows:
        if x["mode"] != "plain":
            depths = range(1, len(x["acceptance_by_depth"]) + 1)
            style = "o-" if x["temperature"] == 0 else "s--"
            name = label(x).replace("\n", " ")
            ax[1].plot(depths, x["acceptance_by_depth"], style, label=f"{name} ({x['acceptance_rate']:.0%})")
    ax[1].set(xlabel="draft depth", ylabel="share accepted", ylim=(0, 1.05), title="MTP acceptance by depth")
    ax[1].set_xticks([1, 2, 3])
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
