"""The yardstick: the harness's model and data trained by plain PyTorch in one process.

Nothing from baton.train.parallel is used: the whole CausalLM, the whole batch, F.cross_entropy,
torch.nn.utils.clip_grad_norm_ and AdamW, as anyone would write it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton.common.model import build_model
from baton.train.backends import param_groups

from .harness import CLIP, MODEL, OPTIM, STEPS, batch


def reference_run() -> dict:
    torch.manual_seed(0)
    model = build_model(MODEL, seed=0)
    groups, _ = param_groups(model, OPTIM.weight_decay)
    opt = torch.optim.AdamW(groups, lr=OPTIM.lr, betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps)
    rec: dict = {"losses": [], "norms": [], "grads": []}
    for step in range(STEPS):
        tokens = batch(step)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        rec["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        rec["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        rec["losses"].append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    rec["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return rec
