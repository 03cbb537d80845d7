"""Peak memory per rank while `init_from` loads a checkpoint, with and without meta-device init.

With meta-device init (what `baton train` does for init_from) the model is built on the meta
device and each rank reads only its shards from the safetensors files (baton.train.pretrained);
without it, every rank first builds the whole model in memory (as `baton train` builds a fresh
one), copies the checkpoint's tensors into it one by one, and the backend shards that. Both at world size 2 on
an HF Llama checkpoint that transformers writes here, fp32:

- FSDP2 (torch3d, dp=2) and TP=2 (torch3d): the weights are in the shards once the backend is built;
- ZeRO-3 (DeepSpeed): once the zero.Init model is filled, before deepspeed.initialize adds the
  float32 master partitions (optimizer state, the same either way);
- DDP (backend torch): every rank holds the whole model by design; the meta path reads the
  tensors straight into a meta-built model instead of over a randomly initialised one.

Peak RSS is the kernel's high-water mark (VmHWM), reset through /proc/self/clear_refs just before
the model is built, minus the RSS at that moment: what building and loading added. Each mode and
path runs in its own 2-rank torchrun group. A whole fp32 copy of the model is 4 bytes x parameters.

The ranks run with MALLOC_MMAP_THRESHOLD_=65536, so RSS is the memory that is live: with glibc's
default (a threshold that grows up to 32 MiB as large blocks are freed), a tensor freed after use
(ZeRO-3's one gathered parameter at a time) stays in the heap, fragmented, and RSS only ever grows:
at the smoke size ZeRO-3's meta path then peaks at 88-97 MiB for a 65 MiB model although never more
than one gathered tensor was alive. `--default-malloc` measures that.

    .venv/bin/python benchmarks/train_init_memory.py [--smoke] [--out DIR]

Writes DIR/train_init_memory.{json,png} (default benchmarks/results) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODELS = {  # HF LlamaConfig keywords
    "full": dict(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12),
    "smoke": dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8),
}
MODES = {  # name -> (overrides, when the weights are in this rank's shards: "model" or "backend")
    "FSDP2 (dp=2)": (["backend=torch3d", "parallel.dp=2"], "backend"),
    "TP=2": (["backend=torch3d", "parallel.tp=2"], "backend"),
    "ZeRO-3": (["backend=deepspeed", "deepspeed.stage=3"], "model"),
    "DDP": ([], "model"),
}
SMOKE_MODES = ("FSDP2 (dp=2)", "ZeRO-3")
MMAP_THRESHOLD = 1 << 16  # bytes: every larger block is its own mapping, unmapped when freed


def status(key: str) -> int:
    """A /proc/self/status memory line (VmRSS, VmHWM, RssAnon, RssFile) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def make_checkpoint(directory: Path, model: dict) -> Path:
    """A random-weight HF Llama checkpoint and a char tokenizer (its vocabulary fits the embedding)."""
    import torch
    import transformers

    from baton.common.tokenizer import train_char

    if (directory / "config.json").is_file():
        return directory
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**model, max_position_embeddings=128, tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(directory)
    train_char("".join(chr(32 + i) for i in range(90))).save(directory)
    return directory


def worker(mode: str, meta: bool, ckpt: str, corpus: str, out: str) -> None:
    import torch

    from baton.common.model import build_model
    from baton.train.backends import build_backend
    from baton.train.recipe import config_from_dict
    from baton.train.distributed import init_distributed
    from baton.train.pretrained import PretrainedWeights, pretrained_model
    from baton.train.recompute import apply_recompute

    cfg = config_from_dict(
        {
            "init_from": ckpt,
            "data": {"path": corpus, "seq_len": 64},
            "micro_batch_size": 2,
            "logging": {"progress": False, "mfu": False, "plot": False, "tensorboard": False},
        },
        MODES[mode][0],
    )
    dist = init_distributed(need_group=True)
    model_cfg = cfg.model_config(1)
    weights = PretrainedWeights(ckpt, model_cfg)
    if cfg.backend == "deepspeed":  # DeepSpeed's own start-up (ops, communication) is not the model's
        from baton.train.backends.deepspeed import _init_deepspeed

        _init_deepspeed(cfg)
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    rss0 = status("VmRSS")
    if meta:
        model = pretrained_model(cfg, model_cfg, dist, weights)
    else:  # the whole model built in memory, then the checkpoint copied in tensor by tensor
        model = build_model(model_cfg, seed=0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(weights[name])
    after_model = status("VmHWM") - rss0
    backend = build_backend(cfg, model, apply_recompute(model, cfg.recompute), dist, weights if meta else None)
    after_backend = status("VmHWM") - rss0
    report = {
        "peak_model_bytes": after_model,
        "peak_backend_bytes": after_backend,
        "held_param_bytes": backend.memory()["accelerator"]["params"] + backend.memory()["host"].get("params", 0),
        "rss_file_bytes": status("RssFile"),
        "parameters": model_cfg.num_parameters(),
    }
    del backend, model
    reports = dist.all_gather_object(report)
    if dist.is_main:
        Path(out).write_text(json.dumps(reports))
    torch.distributed.barrier()


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    names = list(dict.fromkeys(r["mode"] for r in rows))
    width = 0.38
    for i, (meta, label, color) in enumerate(((False, "whole model first", "C3"), (True, "meta-device init", "C0"))):
        vals = [
            max(r["loaded_peak_bytes"]) / 2**20 for n in names for r in rows if r["mode"] == n and r["meta"] == meta
        ]
        ax.bar([x + (i - 0.5) * width for x in range(len(names))], vals, width, label=label, color=color)
    full = rows[0]["full_model_bytes"] / 2**20
    ax.axhline(full, color="k", ls="--", lw=1, label=f"one whole fp32 copy ({full:.0f} MiB)")
    ax.set_ylim(0, 1.35 * max(max(r["loaded_peak_bytes"]) for r in rows) / 2**20)
    ax.set_xticks(range(len(names)), names)
    ax.set(ylabel="peak MiB added per rank (max over ranks)", title="Loading a checkpoint at world size 2")
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a smaller model, FSDP2 and ZeRO-3 only")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--default-malloc", action="store_true", help="glibc's dynamic mmap threshold (see the docstring)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--meta", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, bool(args.meta), args.ckpt, args.corpus, args.result)
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    if not args.default_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = make_checkpoint(tmp / "hf", MODELS["smoke" if args.smoke else "full"])
        corpus = tmp / "corpus.txt"
        corpus.write_text("".join(chr(32 + (i * 7) % 90) for i in range(20_000)))
        for mode in SMOKE_MODES if args.smoke else MODES:
            for meta in (False, True):
                result = tmp / "result.json"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
                cmd += ["--worker", mode, "--meta", str(int(meta)), "--ckpt", str(ckpt), "--corpus", str(corpus)]
                subprocess.run([*cmd, "--result", str(result)], env=env, check=True)
                ranks = json.loads(result.read_text())
                key = "peak_model_bytes" if MODES[mode][1] == "model" else "peak_backend_bytes"
                rows.append(
                    {
                        "mode": mode,
                        "meta": meta,
                        "parameters": ranks[0]["parameters"],
                        "full_model_bytes": 4 * ranks[0]["parameters"],
                        "loaded_at": MODES[mode][1],
                        "loaded_peak_bytes": [r[key] for r in ranks],
                        "ranks": ranks,
                    }
                )
    meta = {"malloc": "glibc default" if args.default_malloc else f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}"}
    (args.out / "train_init_memory.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    plot(rows, args.out / "train_init_memory.png")
    mib = lambda x: f"{x / 2**20:.1f}"  # noqa: E731
    print(f"\nΨ = {rows[0]['parameters']:,} parameters; one whole fp32 copy = {mib(rows[0]['full_model_bytes'])} MiB")
    print("MiB added per rank (rank 0 / rank 1), world size 2\n")
    print("| mode | init | peak, weights loaded | peak, backend built | parameters held |")
    print("|---|---|---|---|---|")
    for r in rows:
        pair = lambda k: " / ".join(mib(x[k]) for x in r["ranks"])  # noqa: E731
        init = "meta device" if r["meta"] else "whole model first"
        print(
            f"| {r['mode']} | {init} | {' / '.join(mib(x) for x in r['loaded_peak_bytes'])} | "
            f"{pair('peak_backend_bytes')} | {pair('held_param_bytes')} |"
        )


if __name__ == "__main__":
    main()
