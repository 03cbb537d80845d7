"""Train recipes one after another in one process group (as multi_run.py) and report, per run and
rank, the dtypes each backend really used, read from its live objects: what a decoder matmul
produced during training, the module's parameters, the tensors the optimizer steps (its master
weights) and its moments, and the dtype gradients are reduced in. A run that resumes a checkpoint
also reports how far its master weights, right after loading, are from the checkpoint's float32
weights (run it with max_steps equal to the checkpoint's step: nothing trains after the load).

Usage: precision_run.py RECIPE ROOT NAME=override,override ... -> ROOT/NAME/precision_rank{r}.json
"""

import gc
import json
import sys
from pathlib import Path

import torch

from baton.train.backends.readers import read_any
from baton.train.distributed import init_distributed
from baton.train.recipe import load_config
from baton.train.trainer import Trainer


def names(dtypes) -> list[str]:
    return sorted({str(d).removeprefix("torch.") for d in dtypes})


def optimizers(backend) -> list[torch.optim.Optimizer]:
    """The torch optimizers that hold the moments (inside DeepSpeed's wrappers)."""
    kind = type(backend).__name__
    if kind == "DDPBackend":
        return [backend.optimizer]
    if kind == "Torch3DBackend":
        return backend.engine.optimizers
    opt = backend.engine.optimizer
    return [opt.optimizer if hasattr(opt, "optimizer") else opt]


def masters(backend) -> list[torch.Tensor]:
    """The float tensors the optimizer updates: DeepSpeed's master partitions, else the parameters."""
    if type(backend).__name__ != "DeepSpeedBackend":
        return [p for opt in optimizers(backend) for g in opt.param_groups for p in g["params"]]
    opt = backend.engine.optimizer
    for attr in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):  # ZeRO-3, ZeRO-1/2
        if hasattr(opt, attr):
            return list(getattr(opt, attr))
    if hasattr(opt, "fp32_groups"):  # stage 0 under bf16/fp16: FP16_UnfusedOptimizer
        return [t for g in opt.fp32_groups for t in g]
    return [p for g in opt.param_groups for p in g["params"]]


def full_masters(backend) -> dict[str, torch.Tensor]:
    """Whole float32 master weights by parameter name (DeepSpeed: gathered by its own utilities)."""
    if type(backend).__name__ != "DeepSpeedBackend":
        return {n: p.detach().float() for n, p in backend.module.named_parameters()}
    from deepspeed.utils import safe_get_full_fp32_param

    named = dict(backend.engine.module.named_parameters())
    if backend.stage == 0:
        order = [n for group in backend.group_names for n in group]
        return dict(zip(order, masters(backend)))
    return {n: safe_get_full_fp32_param(p) for n, p in named.items()}


def reduce_dtype(backend, grad_dtypes: set) -> list[str]:
    kind = type(backend).__name__
    if kind == "DeepSpeedBackend":
        return names([backend.engine.communication_data_type])
    if kind == "Torch3DBackend" and backend.engine.data_parallel and backend.engine.layout.dp_mode == "fsdp":
        return names(r._get_fsdp_state()._mp_policy.reduce_dtype or torch.float32 for r in backend.engine.runners)
    return names(grad_dtypes)  # DDP (and a lone replica) reduce the gradients in their own dtype


def main(recipe: str, root: str, specs: list[str]) -> None:
    dist = init_distributed(need_group=True)
    for spec in specs:
        name, _, overrides = spec.partition("=")
        cfg = load_config(recipe, [f"out_dir={root}/{name}", *filter(None, overrides.split(","))])
        trainer = Trainer(cfg)
        backend, seen, grads = trainer.backend, set(), set()
        layers = backend.module.model.layers
        layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, out: seen.add(out.dtype))
        weight = layers[0].self_attn.q_proj.weight
        weight.register_post_accumulate_grad_hook(lambda p: grads.add(p.grad.dtype))
        loaded = {}
        if Path(cfg.checkpoint.resume).is_dir():  # just loaded: the masters against the checkpoint's weights
            ckpt = Path(cfg.checkpoint.resume)
            saved = read_any(ckpt, json.loads((ckpt / "trainer_state.json").read_text())["layout"]["backend"])
            mine = full_masters(backend)
            loaded = {
                "dtypes": names(t.dtype for t in mine.values()),
                "max_abs_diff": max((mine[n].cpu() - saved.weights[n]).abs().max().item() for n in saved.weights),
            }
        trainer.fit()
        moments = [t for opt in optimizers(backend) for st in opt.state.values() for k, t in st.items() if k != "step"]
        report = {
            "compute": names(seen),
            "params": names(p.dtype for p in backend.module.parameters()),
            "masters": names(t.dtype for t in masters(backend)),
            "moments": names(t.dtype for t in moments),
            "reduce": reduce_dtype(backend, grads),
            "loaded": loaded,
        }
        (Path(root) / name / f"precision_rank{dist.rank}.json").write_text(json.dumps(report) + "\n")
        del trainer, backend
        gc.collect()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
