"""LayerSkip at T=2 tensor parallelism: plain vs the mirror draft vs KV reuse on the ranks, same run.

"mirror" is the draft before the sharded reuse (DistributedRunner.install_late_entry patched to return None in
the driver, so the proposer falls back exactly as a pipeline-parallel engine does: the checkpoint's
first E layers in the engine process, their own cache); "reuse" is serve/runner/late_entry.py. Each
side is a fresh `LLM(..., tensor_parallel_size=2)` over benchmarks/speculative.py's
layerskip-trained `--quick` char model (train it first with that script), decoding its 8 natural
and 8 quoting prompts at batch 1 and 8 with speculative.py's timing (prefill outside the timed
region, 48 greedy tokens). Sides alternate within each round; medians over rounds, ranges kept.
Every side's tokens must equal plain decoding's. Run it alone (flock + chrt, docs/benchmarks.md).

Usage: python benchmarks/layerskip_parallel.py [--rounds 3] [--exit-layer 2] [--smoke]
       (writes benchmarks/results/layerskip_parallel.{json,png})
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from baton.serve import LLM
from baton.serve.engine import EngineConfig
from baton.serve.parallel import driver
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig
from baton.serve.speculative import SpeculativeConfig
from speculative import RESULTS, SHAKESPEARE, prompt_sets  # the script dir is on sys.path

TARGET = RESULTS / "spec-models" / "quick" / "layerskip" / "handoff"
REUSE = driver.DistributedRunner.install_late_entry


def timed(engine, prompts: list[str], batch: int, max_tokens: int) -> tuple[float, list]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    wall, tokens, outs = 0.0, 0, []
    for g in range(0, len(prompts), batch):
        for i, p in enumerate(prompts[g : g + batch]):
            engine.add_request(f"{g}-{i}", p, params)
        engine.step()  # prefill outside the timed region
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)
                    outs.append((out.request_id, out.outputs[0].token_ids))
        wall += time.perf_counter() - t
    return tokens / wall, sorted(outs)


def side(mode: str, exit_layer: int, sets: dict, batches: tuple[int, ...], max_tokens: int) -> dict:
    driver.DistributedRunner.install_late_entry = (lambda self, exit_layer: None) if mode == "mirror" else REUSE
    spec = None if mode == "plain" else SpeculativeConfig("layerskip", 4, exit_layer=exit_layer)
    cfg = EngineConfig(num_kv_blocks=512, block_size=16, speculative=spec, scheduler=SchedulerConfig(max_num_seqs=8))
    cells = {}
    with LLM(TARGET, cfg, tensor_parallel_size=2) as llm:
        if spec is not None:
            assert llm.engine.speculative.proposer.sharded == (mode == "reuse")
        for name, prompts in sets.items():
            for b in batches:
                cells[f"{name} b{b}"] = timed(llm.engine, prompts, b, max_tokens)
        mal = llm.engine.stats().spec_mean_accepted_length
        late = llm.engine.runner.num_late_rows
    return {"cells": cells, "mean_accepted_length": mal, "late_rows": late}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--exit-layer", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="one round, 2 prompts, 6 tokens: that it runs")
    args = ap.parse_args()
    source = SHAKESPEARE.read_text() if SHAKESPEARE.is_file() else None
    if source is None:
        from baton.common.corpus import default_corpus_text

        source = default_corpus_text()
    n, max_tokens, rounds = (2, 6, 1) if args.smoke else (8, 48, args.rounds)
    sets, batches = dict(prompt_sets(source, n)), (1, n)
    modes = ("plain", "mirror", "reuse")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(rounds):
        for m in modes:
            runs[m].append(side(m, args.exit_layer, sets, batches, max_tokens))
            print(r, m, {c: round(v[0]) for c, v in runs[m][-1]["cells"].items()}, flush=True)
    cells = list(runs["plain"][0]["cells"])
    for m in modes:  # exact: every side's greedy tokens are plain decoding's
        assert all(x["cells"][c][1] == runs["plain"][0]["cells"][c][1] for x in runs[m] for c in cells), m
    table = {
        m: {
            c: {
                "tok_s": statistics.median(x["cells"][c][0] for x in runs[m]),
                "range": [min(x["cells"][c][0] for x in runs[m]), max(x["cells"][c][0] for x in runs[m])],
            }
            for c in cells
        }
        | {"mean_accepted_length": runs[m][0]["mean_accepted_length"], "late_rows": runs[m][0]["late_rows"]}
        for m in modes
    }
    print(f"{'cell':14}" + "".join(f"{m:>22}" for m in modes))
    for c in cells:
        print(f"{c:14}" + "".join(f"{table[m][c]['tok_s']:>16.0f} tok/s" for m in modes))
    out = RESULTS / ("layerskip_parallel-smoke" if args.smoke else "layerskip_parallel")
    report = {"exit_layer": args.exit_layer, "k": 4, "tensor_parallel": 2, "rounds": rounds, "table": table}
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    plot(table, cells, out.with_suffix(".png"))


def plot(table: dict, cells: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.27
    for i, m in enumerate(table):
        ax.bar([j + i * width for j in range(len(cells))], [table[m][c]["tok_s"] for c in cells], width, label=m)
    ax.set_xticks([j + width for j in range(len(cells))], cells)
    ax.set(ylabel="output tokens/s (median)", title="LayerSkip at T=2: mirror draft vs KV reuse on the ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
