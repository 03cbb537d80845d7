"""Speculative decoding benchmark: speedup, acceptance and where speculation stops paying.

Trains (once, cached under benchmarks/results/spec-models/{quick,full}/) a char-level target model
on TinyShakespeare (or the embedded corpus), a one-layer draft model with the same tokenizer, and
self-distilled Medusa heads and an EAGLE head on the frozen target; then decodes the same 8
prompts with each mode at batch 1 (one prompt at a time) and 8 against plain decoding in the same
run, and sweeps batch size to find where speculation loses. Every mode runs 3 times, interleaved
with the others; the median run is reported.

Modes: plain, n-gram, draft chain, draft tree (EAGLE-2 dynamic), Medusa chain, Medusa trees
(dynamic and a fixed topology), lookahead (Jacobi window + n-gram pool), EAGLE chain and EAGLE-2
dynamic tree; LayerSkip self-speculation and CALM confidence exit at 3 thresholds on a
LayerSkip-trained copy of the target (benchmarks/early_exit.py, with CALM's quality: agreement
with full-depth greedy, held-out perplexity). Acceptance is also reported per tree depth (share of
the passes proposing depth d whose accepted path reached it).

Every row's greedy tokens are asserted equal to its plain baseline's (CALM's, not exact, are not),
and each row reports its engine step time (ms/step: a decode step, or one propose + verify pass).

Usage: python benchmarks/speculative.py [--quick]   (writes benchmarks/results/speculative.{json,png})
       python benchmarks/speculative.py --deep [--quick] --no-sweep   (speculative-deep.{json,png}: a 16-layer
         hidden-128 char target, EAGLE's design point, with its own draft, Medusa and EAGLE head)
       python benchmarks/speculative.py --smoke    (tiny random models, one short round: that it runs)
       python benchmarks/speculative.py --target runs/demo/handoff --draft runs/demo-draft/handoff --name speculative-demo
         (the README demo model after configs/demo-draft.yaml, demo-medusa.yaml and demo-eagle.yaml)
       python benchmarks/speculative.py --quick --demo-target runs/demo/handoff --demo-draft runs/demo-draft/handoff
         [--demo-layerskip runs/demo-layerskip/handoff]
         (the char model and the demo model in one run and one table; --only eagle,medusa for a subset)
       --alone-realtime (root): once the models are trained or loaded from the cache, measure under
         SCHED_FIFO (serve_threads.realtime): alone on the cores of a shared machine; it starves the
         other jobs while it runs, so keep such runs short (--quick --no-sweep --repeats 1: a few minutes)
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from baton.common.tokenizer import Tokenizer
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig
from baton.serve.speculative import SpeculativeConfig

RESULTS = Path(__file__).resolve().parent / "results"
SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


# The char target's shapes. "wide" is the table's 6-layer model, where a one-layer EAGLE head or
# draft costs ~1/6 of a target step; "deep" is EAGLE's design point scaled down to this CPU (a
# 32-80-layer target, whose head is 1-3% of a step): 16 narrow layers, a head 1/16 of the target.
TARGETS = {
    "wide": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 6, "num_attention_heads": 8},
    "deep": {"hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 16, "num_attention_heads": 4},
}


def train_models(out: Path, quick: bool, shape: str = "wide") -> tuple[Path, Path, str]:
    from baton.train.recipe import config_from_dict
    from baton.train.medusa import MedusaTrainConfig, train_medusa
    from baton.train.trainer import train

    corpus = str(SHAKESPEARE) if SHAKESPEARE.is_file() else None
    # a deep target's training step costs ~3x the wide one's on this CPU (per-layer dispatch); 300 keeps
    # its training, distillation and heads to about half an hour of one shared core
    steps = 150 if quick else 300 if shape == "deep" else 600
    common = {
        "data": {"path": corpus, "seq_len": 128, "val_fraction": 0.05},
        "micro_batch_size": 12,
        "optim": {"lr": 2e-3, "min_lr": 2e-4, "warmup_steps": 30},
        "eval_interval": 0,
    }
    target, draft = out / "target", out / "draft"
    if not (target / "handoff" / "config.json").is_file():
        train(
            config_from_dict(
                {
                    **common,
                    "out_dir": str(target),
                    "max_steps": steps,
                    "tokenizer": {"kind": "char"},
                    "model": {**TARGETS[shape], "num_key_value_heads": 2, "max_position_embeddings": 512},
                }
            )
        )
    if not (draft / "handoff" / "config.json").is_file():
        train(
            config_from_dict(
                {
                    **common,
                    "out_dir": str(draft),
                    "max_steps": steps,
                    "tokenizer": {"path": str(target / "handoff")},
                    # one layer: on a CPU a forward's cost is mostly per layer, not per width
                    "model": {
                        "hidden_size": 128,
                        "intermediate_size": 352,
                        "num_hidden_layers": 1,
                        "num_attention_heads": 4,
                        "num_key_value_heads": 2,
                        "max_position_embeddings": 512,
                    },
                }
            )
        )
    from baton.common.data import DataConfig

    distilled = out / "distill.jsonl"
    if not distilled.is_file():
        from baton.serve.distill import DistillConfig, write_distillation_corpus

        # self-distillation: the heads learn the target's own greedy continuations (Medusa, section 3.2),
        # written as `baton distill` does, then read like any corpus
        write_distillation_corpus(
            target / "handoff",
            distilled,
            DistillConfig(DataConfig(path=corpus, seq_len=128), samples=96 if quick else 384),
        )
    if not (target / "handoff" / "medusa_config.json").is_file():
        train_medusa(
            MedusaTrainConfig(
                base=str(target / "handoff"),
                data=DataConfig(path=str(distilled), seq_len=128, val_fraction=0),
                num_heads=3,
                steps=steps // 2,
                batch_size=12,
                lr=2e-3,
            )
        )
    train_eagle_head(target / "handoff", distilled, 300 if quick else 400 if shape == "deep" else 600)
    text = SHAKESPEARE.read_text() if SHAKESPEARE.is_file() else ""
    return target / "handoff", draft / "handoff", text


def train_eagle_head(target: Path, distilled: Path, steps: int) -> None:
    """An EAGLE head on the frozen target from its distilled continuations (configs/demo-eagle.yaml's
    settings), once: it is kept in the target's handoff directory."""
    from baton.common.data import DataConfig
    from baton.common.eagle import has_eagle
    from baton.train.eagle import EagleTrainConfig, train_eagle

    if not has_eagle(target):
        data = DataConfig(path=str(distilled), seq_len=128, val_fraction=0)
        train_eagle(EagleTrainConfig(base=str(target), data=data, steps=steps, batch_size=12, lr=3e-3))


MEDUSA_CHOICES = "[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]"  # 6 nodes, 3 deep


def smoke_models(out: Path) -> tuple[Path, Path, str]:
    """Random tiny target (with Medusa heads) and draft: the code paths, not the numbers."""
    from baton.common.checkpoint import save_model
    from baton.common.config import ModelConfig
    from baton.common.medusa import MedusaConfig, MedusaHeads, save_medusa
    from baton.common.model import build_model
    from baton.common.tokenizer import train_char

    text = "To be, or not to be, that is the question. " * 20
    tok = train_char(text)
    cfg = dict(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    target = build_model(ModelConfig(**cfg), seed=0)
    save_model(out / "target", target, tokenizer=tok)
    heads = MedusaHeads(MedusaConfig(cfg["hidden_size"], cfg["vocab_size"], num_heads=3))
    heads.init_from_lm_head(target.lm_head)
    save_medusa(heads, out / "target")
    from baton.common.eagle import EagleConfig, EagleHead, save_eagle

    save_eagle(EagleHead(EagleConfig(target.config.to_dict())), out / "target")
    save_model(out / "draft", build_model(ModelConfig(**{**cfg, "num_hidden_layers": 1}), seed=1), tokenizer=tok)
    return out / "target", out / "draft", text


def modes(draft: Path) -> dict[str, SpeculativeConfig | None]:
    return {
        "plain": None,
        "ngram k=4": SpeculativeConfig("ngram", 4),
        "draft k=4": SpeculativeConfig("draft", 4, draft_model=str(draft)),
        "draft k=6": SpeculativeConfig("draft", 6, draft_model=str(draft)),
        "draft tree k=3 w=2": SpeculativeConfig("draft", 3, draft_model=str(draft), tree_width=2),
        "medusa k=3": SpeculativeConfig("medusa", 3),
        "medusa tree k=3 w=2": SpeculativeConfig("medusa", 3, tree_width=2),
        "medusa tree choices": SpeculativeConfig("medusa", 3, tree_choices=MEDUSA_CHOICES),
        "lookahead W=4 N=4 G=4": SpeculativeConfig("lookahead", lookahead_window=4, lookahead_ngram=4),
        "lookahead W=8 N=5 G=8": SpeculativeConfig(
            "lookahead", lookahead_window=8, lookahead_ngram=5, lookahead_guesses=8
        ),
        "eagle k=4": SpeculativeConfig("eagle", 4),
        "eagle k=6": SpeculativeConfig("eagle", 6),
        "eagle tree k=4 w=2": SpeculativeConfig("eagle", 4, tree_width=2, tree_nodes=8),
        "eagle tree k=5 w=3": SpeculativeConfig("eagle", 5, tree_width=3, tree_nodes=12),
    }


def run(target: Path, spec, prompts: list[str], max_tokens: int, batch: int) -> dict:
    """Decode the prompts `batch` at a time, each group to completion; only decode steps are timed.
    `spec`: a SpeculativeConfig, None (plain), or a dict of other EngineConfig fields (CALM's threshold)."""
    extra = spec if isinstance(spec, dict) else {"speculative": spec}
    engine = LLMEngine.from_checkpoint(
        target,
        EngineConfig(num_kv_blocks=2048, block_size=16, scheduler=SchedulerConfig(max_num_seqs=batch), **extra),
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    wall, tokens, latencies, steps, outputs = 0.0, 0, [], 0, {}
    for g in range(0, len(prompts), batch):
        for i, p in enumerate(prompts[g : g + batch]):
            engine.add_request(f"{g}-{i}", p, params)
        engine.step()  # prefill outside the timed region
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            steps += 1
            for out in engine.step():
                if out.finished:
                    latencies.append((time.perf_counter() - t) / max_tokens)
                    tokens += len(out.outputs[0].token_ids)
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
        wall += time.perf_counter() - t
    s = engine.stats()
    by_depth = engine.speculative.stats.acceptance_by_depth if engine.speculative is not None else []
    return {
        "tokens_per_s": tokens / wall,
        "ms_per_token": 1e3 * sum(latencies) / len(latencies),
        "ms_per_step": 1e3 * wall / steps,  # an engine step: one decode, or one propose + verify pass
        "outputs": outputs,
        "acceptance_rate": s.spec_acceptance_rate,
        "mean_accepted_length": s.spec_mean_accepted_length,
        "acceptance_by_depth": by_depth,
        "engine_speedup": s.spec_speedup,  # what ServerInfo would report (0: no plain decode step seen)
    }


def prompt_sets(source: str, n: int) -> tuple[tuple[str, list[str]], ...]:
    """The workloads: `n` natural 48-character prompts cut out of `source`, and `n` quoting ones (a
    passage twice, then its start again: prompt lookup has something to find)."""
    rng = random.Random(0)
    natural = [source[i : i + 48] for i in (rng.randrange(len(source) - 100) for _ in range(8))]
    passage = [source[i : i + 120] for i in (rng.randrange(len(source) - 200) for _ in range(8))]
    quoting = [p + "\n\n" + p + "\n\n" + p[:40] for p in passage]
    return ("natural", natural[:n]), ("quoting", quoting[:n])


def selected(spec_modes: dict, only: tuple[str, ...], base: str = "plain") -> dict:
    """The modes whose names start with one of `only` (all when empty), and the baseline."""
    return {k: v for k, v in spec_modes.items() if not only or k == base or k.startswith(only)}


REPEATS = 3
# --deep's rows: EAGLE chains and a tree against the other learned proposers' chains
DEEP_ONLY = ("draft k=4", "draft k=6", "medusa k=3", "eagle k=4", "eagle k=6", "eagle tree k=4")
SWEPT = ("ngram k=4", "draft k=4", "draft k=6", "medusa k=3")


def median_runs(
    target: Path, spec_modes: dict, prompts: list[str], max_tokens: int, batch: int, repeats: int
) -> dict[str, dict]:
    """Every mode `repeats` times, interleaved (so drift in the machine's speed hits all modes
    alike); for each mode the run with the median tokens/s."""
    seen: dict[str, list[dict]] = {name: [] for name in spec_modes}
    for _ in range(repeats):
        for name, spec in spec_modes.items():
            seen[name].append(run(target, spec, prompts, max_tokens, batch))
    return {name: sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2] for name, rs in seen.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--target",
        help="measure this handoff checkpoint (with Medusa heads) instead of training one; "
        "prompts then come from the embedded default corpus",
    )
    ap.add_argument("--draft", help="the draft checkpoint for --target")
    ap.add_argument("--name", default="speculative", help="results file name (benchmarks/results/NAME.{json,png})")
    ap.add_argument("--smoke", action="store_true", help="tiny random models, one short round, no sweep")
    ap.add_argument("--repeats", type=int, default=REPEATS, help="runs per mode (the median is reported)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the batch-size sweep")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    ap.add_argument("--only", help="comma-separated mode-name prefixes to run (plain always runs), e.g. eagle,medusa")
    ap.add_argument(
        "--demo-target",
        help="also measure this checkpoint in the same run (the README demo model with its draft, Medusa and "
        "EAGLE heads: configs/demo-*.yaml), on prompts from the embedded default corpus",
    )
    ap.add_argument("--demo-draft", help="the draft checkpoint for --demo-target")
    ap.add_argument(
        "--demo-only",
        action="store_true",
        help="with --demo-target: only the demo model's rows (no char model trained or measured, no sweep)",
    )
    ap.add_argument(
        "--demo-layerskip",
        help="with --demo-target: the demo model's LayerSkip-trained copy (configs with early exits); "
        "its LayerSkip and CALM rows against its own plain decoding",
    )
    ap.add_argument(
        "--deep",
        action="store_true",
        help="the deep narrow char target instead (16 layers, hidden 128: EAGLE's design point, a head ~1/16 of a "
        "step), trained and cached under spec-models/deep with its own draft, Medusa and EAGLE heads; its rows "
        "default to --only " + ",".join(DEEP_ONLY),
    )
    ap.add_argument(
        "--alone-realtime",
        action="store_true",
        help="measure under SCHED_FIFO (root), after training: alone on the cores of a shared machine",
    )
    args = ap.parse_args()
    only = tuple(args.only.split(",")) if args.only else DEEP_ONLY if args.deep else ()
    if args.deep and (args.target or args.smoke):
        ap.error("--deep trains its own target; it does not combine with --target or --smoke")
    if args.deep and args.name == "speculative":
        args.name = "speculative-deep"
    if args.demo_target and not args.demo_draft:
        ap.error("--demo-target needs --demo-draft")
    if (args.demo_layerskip or args.demo_only) and not args.demo_target:
        ap.error("--demo-layerskip and --demo-only need --demo-target")
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        target, draft, text = smoke_models(args.out / "smoke-models")
        args.repeats, args.no_sweep = 1, True
    elif args.target:
        if not args.draft:
            ap.error("--target needs --draft")
        from baton.common.corpus import default_corpus_text

        target, draft, text = Path(args.target), Path(args.draft), default_corpus_text()
    elif args.demo_only:
        target = draft = None
        text, args.no_sweep = "", True
    elif args.deep:  # always the full training; --quick only shortens the decoded continuations
        target, draft, text = train_models(RESULTS / "spec-models" / "deep", False, "deep")
    else:
        target, draft, text = train_models(RESULTS / "spec-models" / ("quick" if args.quick else "full"), args.quick)
    source = text or "To be, or not to be, that is the question. " * 50
    (_, natural), _ = workloads = prompt_sets(source, 2 if args.smoke else 8)
    max_tokens = 6 if args.smoke else 48 if args.quick else 96
    import subprocess

    git = ["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(git, capture_output=True, text=True).stdout.strip()
    results: dict = {"alone_realtime": args.alone_realtime, "threads": torch.get_num_threads(), "commit": commit}
    from baton.common.checkpoint import read_config

    if target is not None:
        results["target"] = {k: getattr(read_config(target), k) for k in ("num_hidden_layers", "hidden_size")}
    results["rows"] = []
    # LayerSkip and CALM run on a LayerSkip-trained copy of the target, against its own plain decoding
    # (benchmarks/early_exit.py); CALM's rows also carry quality (agreement, held-out perplexity).
    import early_exit

    label = "deep" if args.deep else "char"
    groups = [(label, target, selected(modes(draft), only), "plain", workloads, {})]
    groups = groups if target is not None else []
    wants_ls = not only or any(p.startswith(("layerskip", "calm")) for p in only)
    if wants_ls and target is not None:
        if args.smoke:
            ls_target = early_exit.smoke_target(target, args.out / "smoke-models" / "layerskip")
        else:
            corpus = None if args.target else (str(SHAKESPEARE) if SHAKESPEARE.is_file() else None)
            ls_dir = target.parent.parent / "layerskip"
            ls_target = early_exit.layerskip_target(target, ls_dir, 60 if args.quick else 200, corpus)
        heldout = Tokenizer.from_dir(ls_target).encode(source[-3000:])[: 32 if args.smoke else 400]
        quality = early_exit.quality(ls_target, natural, max_tokens, heldout)
        ls_modes = selected(early_exit.modes(ls_target), only, "plain (layerskip-trained)")
        groups.append((label, ls_target, ls_modes, "plain (layerskip-trained)", workloads, quality))
    if args.demo_target:  # the same modes and settings on the demo model, in the same run
        from baton.common.corpus import default_corpus_text

        demo_prompts = prompt_sets(default_corpus_text(), 8)
        demo_modes = selected(modes(Path(args.demo_draft)), only)
        groups.append(("demo", Path(args.demo_target), demo_modes, "plain", demo_prompts, {}))
        if args.demo_layerskip and wants_ls:  # the demo model's LayerSkip copy, with its own CALM quality
            ls_demo = Path(args.demo_layerskip)
            held = Tokenizer.from_dir(ls_demo).encode(default_corpus_text()[-3000:])[:400]
            demo_quality = early_exit.quality(ls_demo, demo_prompts[0][1], max_tokens, held)
            ls_modes = selected(early_exit.modes(ls_demo), only, "plain (layerskip-trained)")
            groups.append(("demo", ls_demo, ls_modes, "plain (layerskip-trained)", demo_prompts, demo_quality))
    if args.alone_realtime:  # from here on this process runs ahead of every normal one (the LayerSkip
        # copy's training and CALM's quality pass above ran at normal priority)
        from serve_threads import realtime

        realtime()
    for model, group_target, group_modes, base, group_workloads, quality in groups:
        for workload, prompts in group_workloads:
            for batch in (1, 2) if args.smoke else (1, 8):
                runs = median_runs(group_target, group_modes, prompts, max_tokens, batch, args.repeats)
                outputs = {name: r.pop("outputs") for name, r in runs.items()}
                for name, r in runs.items():
                    # exact: every mode but CALM (a dict of engine fields) decodes plain's greedy tokens
                    same = outputs[name] == outputs[base]
                    assert same or isinstance(group_modes[name], dict), f"{name} {workload} b{batch} is not exact"
                    r["exact"] = same
                    speedup = r["tokens_per_s"] / runs[base]["tokens_per_s"]
                    r.update(workload=workload, batch=batch, mode=name, speedup=speedup, **quality.get(name, {}))
                    results["rows"].append({"model": model, **r})
    sweep = []
    sweep_modes = {} if args.no_sweep else {k: v for k, v in modes(draft).items() if k in ("plain", *SWEPT)}
    for batch in () if args.no_sweep else (1, 2, 4, 8, 16, 32):
        runs = median_runs(target, sweep_modes, (natural * 4)[: max(8, batch)], max_tokens, batch, args.repeats)
        outputs = [r.pop("outputs") for r in runs.values()]
        assert all(o == outputs[0] for o in outputs), f"not exact at batch {batch}"  # plain's are the first
        base = runs["plain"]["tokens_per_s"]
        sweep.append(
            {"batch": batch, "plain": base, **{k: r["tokens_per_s"] / base for k, r in runs.items() if k != "plain"}}
        )
    results["batch_sweep"] = sweep
    (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=2))
    print(
        f"\n{'model':<6}{'workload':<11}{'batch':>6}  {'mode':<26}{'tok/s':>8}{'ms/tok':>8}{'ms/step':>8}{'speedup':>9}"
        f"{'accept':>8}{'mean len':>9}  accept by depth"
    )
    for r in results["rows"]:
        depths = " ".join(f"{a:.0%}" for a in r["acceptance_by_depth"])
        if "ppl" in r:  # CALM and its baseline: quality (agreement with full depth, held-out perplexity)
            depths += f"agree {r['agreement']:.0%} ppl {r['ppl']:.3f}"
        print(
            f"{r['model']:<6}{r['workload']:<11}{r['batch']:>6}  {r['mode']:<26}{r['tokens_per_s']:>8.0f}{r['ms_per_token']:>8.2f}"
            f"{r['ms_per_step']:>8.2f}{r['speedup']:>8.2f}x{r['acceptance_rate']:>8.0%}{r['mean_accepted_length']:>9.2f}  {depths}"
        )
    print("\nspeedup over plain decoding by batch size (natural prompts):")
    for row in sweep:
        print(
            f"  batch {row['batch']:>3}: plain {row['plain']:.0f} tok/s; "
            + ", ".join(f"{k} {row[k]:.2f}x" for k in SWEPT)
        )
    plot(results, args.out / f"{args.name}.png")


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [x for x in r["rows"] if x["mode"] != "plain"]
    sweep = r["batch_sweep"]
    # one bar a row, tall enough to read (no sweep panel when the run skipped it)
    fig, ax = plt.subplots(1, 2 if sweep else 1, figsize=(12 if sweep else 8, max(4, 0.14 * len(rows))), squeeze=False)
    ax = ax[0]
    labels = [f"{x['model']} {x['workload'][:3]} b{x['batch']}  {x['mode']}" for x in rows]
    ax[0].barh(range(len(rows)), [x["speedup"] for x in rows])
    ax[0].set_yticks(range(len(rows)), labels, fontsize=6)
    ax[0].invert_yaxis()
    ax[0].axvline(1.0, c="gray", ls="--")
    ax[0].set(xlabel="speedup over plain decoding", title="speculative decoding on this CPU")
    if sweep:
        for k in SWEPT:
            ax[1].plot([x["batch"] for x in sweep], [x[k] for x in sweep], "o-", label=k)
        ax[1].axhline(1.0, c="gray", ls="--")
        ax[1].set(xscale="log", xlabel="batch size", ylabel="speedup", title="where speculation stops paying")
        ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
