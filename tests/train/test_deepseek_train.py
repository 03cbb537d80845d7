"""DeepSeek-V3 training (balancing, the sequence-wise loss, MTP, EP, init_from), each against an
independent reference.

- One 2-rank gloo launch (this file is its torchrun script): a tiny DeepSeek-V3 with MTP at DDP,
  FSDP2 and FSDP2 + EP=2, balancing on, has one plain process's losses, gradient norms, MTP losses
  and correction biases (that process moves each bias from its own counts), the same biases on both
  ranks (DDP broadcasts buffers at every forward; FSDP2 and EP do not: they show the loads are
  summed over ranks). Then `baton train` fine-tunes a transformers checkpoint at torch3d dp=2 x ep=2
  and ZeRO-3 with the one-process run's losses and handoffs transformers loads.
- One process: the MTP and sequence-wise losses' injected gradients equal the explicit total's, both
  computed by hand from the modules' parts; `baton train`: a skewed router evened out by the bias
  (not without it), MTP trained and handed off (transformers ignores the module, Baton loads it),
  init_from at transformers' loss; bad recipes refused before any work.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
import yaml
from baton.common.checkpoint import load_checkpoint, load_state_dict, save_model
from baton.common.config import ConfigError, ModelConfig
from baton.common.deepseek_moe import DeepSeekMoE
from baton.common.model import CausalLM, DenseCausalAttention, build_model
from baton.common.rope import rotary_cos_sin
from baton.common.tokenizer import Tokenizer, train_char
from baton.train.backends import build_backend, param_groups
from baton.train.backends.readers import read_any
from baton.train.balancing import attach_balancing
from baton.train.config import OptimConfig
from baton.train.distributed import Dist, init_distributed
from baton.train.moe import attach_router_losses, router_metrics
from baton.train.mtp import MTPLoss
from baton.train.parallel.layout import ParallelConfig, check_layout
from baton.train.parallel.mesh import build_mesh
from baton.train.parallel.parallelize import Parallel3D
from baton.train.recipe import config_from_dict, load_config
from baton.train.trainer import train

# The tiny DeepSeek-V3 (MLA with a low-rank query, 8 routed experts in 2 groups, top-2 from the
# best group, a shared expert, a dense first layer) in HF's names, shared with the transformers checkpoint.
# fmt: off
SHAPE = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=4, q_lora_rank=24,
             kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_experts_per_tok=2, n_group=2,
             topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
             max_position_embeddings=64)
# fmt: on
MODEL = ModelConfig(
    model_type="deepseek_v3",
    vocab_size=128,
    num_hidden_layers=2,
    num_local_experts=8,
    num_nextn_predict_layers=1,
    **SHAPE,
)
SEQ, GLOBAL_BATCH, STEPS = 16, 4, 5  # micro-batches of one sequence: 2 per rank at world size 2
RATE, SEQ_COEF, MTP_WEIGHT = 0.01, 0.01, 0.3
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1)
CLIP = 1.0
CASES = {"ddp": {}, "fsdp2": dict(dp=2), "ep2": dict(dp=2, ep=2)}
# `baton train` runs of the launch: init_from a transformers checkpoint (the pytest side writes it)
TRAINER_RUNS = {
    "torch3d_ep2": ["backend=torch3d", "parallel.dp=2", "parallel.ep=2"],
    "zero3": ["backend=deepspeed", "deepspeed.stage=3"],
}
FINE_TUNE_STEPS = 3


def batch(step: int) -> torch.Tensor:
    """[GLOBAL_BATCH, SEQ + 1] arithmetic progressions mod the vocabulary (learnable)."""
    g = torch.Generator().manual_seed(3000 + step)
    start = torch.randint(0, MODEL.vocab_size, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 6, (GLOBAL_BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % MODEL.vocab_size


def deepseek_training(model: CausalLM, micro_batches: int):
    """What the trainer attaches: the sequence-wise loss, the balancer, the MTP objective."""
    attach_router_losses(model, None, None, micro_batches, SEQ_COEF)
    return attach_balancing(model, RATE, SEQ_COEF), MTPLoss(model, MTP_WEIGHT, micro_batches)


# ----------------------------------------------------------------------------- torchrun side
def run_case(name: str, out: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    per = GLOBAL_BATCH // world
    model = build_model(MODEL, seed=0)
    if name == "ddp":  # backend torch under torchrun, built as the trainer builds it
        recipe = {
            "model": MODEL.to_dict(),
            "data": {"seq_len": SEQ},
            "micro_batch_size": 1,
            "global_batch_size": GLOBAL_BATCH,
            "optim": {"lr": OPTIM.lr, "weight_decay": OPTIM.weight_decay, "grad_clip": CLIP, "warmup_steps": 0},
        }
        backend = build_backend(config_from_dict(recipe), model, DenseCausalAttention(), Dist(rank, world, rank))
    else:
        layout = check_layout(ParallelConfig(**CASES[name]), MODEL, world, per, SEQ)
        engine = Parallel3D(model, build_mesh(layout), per, OPTIM)
    balancer, mtp = deepseek_training(model, per)
    rec: dict = {key: [] for key in ("losses", "norms", "biases", "mtp")}
    for step in range(STEPS):
        parts = list(batch(step)[rank * per : (rank + 1) * per].chunk(per))
        mtp.feed(parts)
        if name == "ddp":
            result = backend.train_step(parts, OPTIM.lr)
            loss, norm = result.loss, result.grad_norm
        else:
            loss = engine.forward_backward(parts)
            dist.all_reduce(loss)
            loss = loss.item() / world
            _, norm = engine.clip_and_step(OPTIM.lr, CLIP, True)
        balancer.step(True)
        for key, value in zip(rec, (loss, norm, balancer.biases(), mtp.metrics()["mtp_loss"])):
            rec[key].append(value)
    rec["held"] = sorted({n for n, _ in model.named_parameters() if ".experts." in n})
    torch.save(rec, out / name / f"rank{rank}.pt")


def main(out: Path, recipe: Path) -> None:
    torch.set_num_threads(1)
    init_distributed(need_group=True)  # (the trainer runs join the same group)
    for name in CASES:
        (out / name).mkdir(parents=True, exist_ok=True)
        run_case(name, out)
        dist.barrier()
    for name, overrides in TRAINER_RUNS.items():
        train(load_config(recipe, [f"out_dir={out / name}", *overrides]))


# ------------------------------------------------------------------------------- pytest side
@pytest.fixture(scope="module")
def reference() -> dict:
    """One process, every micro-batch of the step one after another; each bias moved by the sign
    rule from this process's own counts (DeepSeekMoE.update_bias, no all-reduce)."""
    model = build_model(MODEL, seed=0)
    _, mtp = deepseek_training(model, GLOBAL_BATCH)
    groups, _ = param_groups(model, OPTIM.weight_decay)
    opt = torch.optim.AdamW(groups, lr=OPTIM.lr, betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps)
    layers = [m for m in model.modules() if isinstance(m, DeepSeekMoE)]
    rec: dict = {key: [] for key in ("losses", "norms", "biases", "mtp")}
    for step in range(STEPS):
        parts = list(batch(step).chunk(GLOBAL_BATCH))
        mtp.feed(parts)
        total = 0.0
        for row in parts:
            loss = F.cross_entropy(model(row[:, :-1]).flatten(0, 1), row[:, 1:].flatten())
            (loss / GLOBAL_BATCH).backward()
            total += loss.item()
        rec["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        for m in layers:
            m.update_bias(RATE)
        rec["losses"].append(total / GLOBAL_BATCH)
        rec["biases"].append([m.gate.e_score_correction_bias.clone() for m in layers])
        rec["mtp"].append(mtp.metrics()["mtp_loss"])
    return rec


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A corpus; a transformers DeepseekV3ForCausalLM (random weights, norms and correction biases
    moved off their initial values) saved with save_pretrained ("hf"), and MODEL with its MTP module
    saved by Baton ("mtp"), each with a char tokenizer."""
    from .conftest import PATTERN_TEXT

    root = tmp_path_factory.mktemp("deepseek_files")
    (root / "corpus.txt").write_text(PATTERN_TEXT)
    config = transformers.DeepseekV3Config(
        **SHAPE, vocab_size=72, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8, initializer_range=0.1
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)  # (steers the choice: the loss depends on it being read)
    hf.save_pretrained(root / "hf")
    train_char(PATTERN_TEXT).save(root / "hf")
    model = build_model(dataclasses.replace(MODEL, vocab_size=72, initializer_range=0.1), seed=1)
    with torch.no_grad():
        for b in model.buffers():
            b.copy_(torch.randn_like(b) * 0.1)
    save_model(root / "mtp", model, tokenizer=train_char(PATTERN_TEXT))
    return root, hf


def fine_tune_recipe(root: Path, out: Path, source: str = "hf", **extra) -> dict:
    return tiny_recipe(root, out, root / source, max_steps=FINE_TUNE_STEPS, export=True, **extra)


@pytest.fixture(scope="module")
def runs(files, tmp_path_factory) -> dict:
    from .parallel.conftest import torchrun

    root, _ = files
    out = tmp_path_factory.mktemp("deepseek")
    (out / "recipe.yaml").write_text(yaml.safe_dump(fine_tune_recipe(root, out / "unused", "mtp")))
    torchrun(2, [__file__, str(out), str(out / "recipe.yaml")], out / "launch.log")
    cases = {name: [torch.load(out / name / f"rank{r}.pt", weights_only=True) for r in range(2)] for name in CASES}
    return {**cases, "out": out}


TOL = 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_layout_trains_like_one_process_with_identical_biases(runs, reference, case):
    ranks, ref = runs[case], reference
    assert ref["losses"][-1] < ref["losses"][0] - 0.1 and ref["mtp"][-1] < ref["mtp"][0]  # both objectives learn
    for key in ("losses", "norms", "mtp"):
        rel = [abs(a - b) / b for a, b in zip(ranks[0][key], ref[key])]
        assert max(rel) < TOL, f"{case} {key}: {rel}"
    for step, want in enumerate(ref["biases"]):
        for r in ranks:
            for got, exp in zip(r["biases"][step], want):
                assert torch.equal(got, exp), f"{case} step {step}: bias {got} != one process's {exp}"
    assert sum(int((b != 0).sum()) for b in ref["biases"][-1]) > 0  # (the biases did move)
    # EP=2 dealt out the experts (of the MoE layer and of the MTP block's): rank 0 holds 0-3, rank 1 4-7.
    for rank, rec in enumerate(ranks):
        held = {(n.split(".experts.")[0], int(n.split(".experts.")[1].split(".")[0])) for n in rec["held"]}
        want = (range(4) if rank == 0 else range(4, 8)) if case == "ep2" else range(8)
        assert held == {(p, e) for p in ("model.layers.1.mlp", "mtp.0.block.mlp") for e in want}, held


def sequence_loss_by_hand(logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 eq. 17-20 term by term for one sequence of T tokens: sum_i f_i P_i, f_i = E / (k T)
    x the tokens that chose i, P_i = mean over the tokens of s_i / sum_j s_j (s: sigmoid affinities)."""
    (t, experts), k, s = logits.shape, chosen.shape[1], logits.sigmoid()
    total = logits.new_zeros(())
    for i in range(experts):
        f = experts / (k * t) * sum(int(i in row) for row in chosen.tolist())
        total = total + f * sum(s[r, i] / s[r].sum() for r in range(t)) / t
    return total


def test_injected_mtp_and_sequence_losses_equal_the_explicit_total():
    """backward(CE) with the trainer's hooks == backward(CE + lambda x L_MTP + alpha x mean over layers
    of L_seq) per micro-batch / micro-batches, with L_MTP (module 1 by hand from its parts: enorm,
    hnorm, eh_proj, block, shared_head.norm, lm_head, targets two ahead) and L_seq (term by term)
    computed by hand; the logged values are the hand values."""
    micro = 2
    blocks = list(batch(0)[:micro].chunk(micro))
    biases = torch.randn(2, MODEL.num_local_experts, generator=torch.Generator().manual_seed(5)) * 0.05

    def with_biases(model: CausalLM) -> list[DeepSeekMoE]:
        layers = [m for m in model.modules() if isinstance(m, DeepSeekMoE)]  # (the MoE layer, the MTP block's)
        for m, b in zip(layers, biases):
            m.gate.e_score_correction_bias.copy_(b)
        return layers

    model = build_model(MODEL, seed=0)
    with_biases(model)
    _, mtp = deepseek_training(model, micro)
    mtp.feed(blocks)
    for b in blocks:
        (F.cross_entropy(model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten()) / micro).backward()
    injected = {n: p.grad for n, p in model.named_parameters()}
    logged = {**router_metrics(model), **mtp.metrics()}

    ref = build_model(MODEL, seed=0)
    layers, captured = with_biases(ref), []
    for m in layers:
        m.gate.register_forward_hook(lambda mod, args, out, m=m: captured.append((out, m.route(out)[1])))
    seq_values, mtp_values = [], []
    for b in blocks:
        ids, s = b[:, :-1], b.shape[1] - 1
        h = ref.model(ids, torch.arange(s).expand_as(ids), DenseCausalAttention())
        ce = F.cross_entropy(ref.lm_head(h).flatten(0, 1), b[:, 1:].flatten())
        m = ref.mtp[0]
        x = m.eh_proj(torch.cat([m.enorm(ref.model.embed_tokens(b[:, 1:s])), m.hnorm(h[:, : s - 1])], dim=-1))
        cos, sin = rotary_cos_sin(ref.model.inv_freq, torch.arange(s - 1).expand(1, -1), x.dtype)
        out = m.shared_head.norm(m.block(x, cos, sin, DenseCausalAttention()))
        mtp_loss = F.cross_entropy(ref.lm_head(out).flatten(0, 1), b[:, 2:].flatten())
        seq = [sequence_loss_by_hand(lg, ch) for lg, ch in captured]
        captured.clear()
        ((ce + MTP_WEIGHT * mtp_loss + SEQ_COEF * sum(seq) / len(seq)) / micro).backward()
        seq_values += [v.item() for v in seq]
        mtp_values.append(mtp_loss.item())
    for n, p in ref.named_parameters():
        torch.testing.assert_close(injected[n], p.grad, rtol=1e-5, atol=1e-8, msg=n)
    assert logged["moe_seq_aux_loss"] == pytest.approx(sum(seq_values) / len(seq_values), rel=1e-5)
    assert logged["mtp_loss"] == pytest.approx(sum(mtp_values) / len(mtp_values), rel=1e-5)


# ------------------------------------------------------------------------------ baton train
def tiny_recipe(root: Path, out: Path, init_from: Path | None = None, **extra) -> dict:
    """test_init_from's recipe (32-token blocks, logs every step), from scratch where init_from is None."""
    from .test_init_from import recipe

    return {**recipe(root / "corpus.txt", out, init_from or root, **extra), "init_from": init_from and str(init_from)}


def records(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def check_handoff(out_dir: Path, mtp: bool) -> None:
    """The handoff holds the run's trained weights and correction biases (an MTP module as
    model.layers.{N}.*, loaded by Baton into CausalLM.mtp); transformers loads it with Baton's logits."""
    ckpt = sorted((out_dir / "checkpoints").glob("step_*"))[-1]
    backend = json.loads((ckpt / "trainer_state.json").read_text())["layout"]["backend"]
    trained = read_any(ckpt, backend, with_optimizer=False).weights
    ours = load_checkpoint(out_dir / "handoff").model.float().eval()
    assert (ours.mtp is not None) == mtp
    state = ours.state_dict()
    assert any(".e_score_correction_bias" in n for n in state)
    for name, t in state.items():
        assert torch.equal(t, trained[name]), f"handoff {name} is not the trained tensor"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir / "handoff").float().eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    tokens = torch.randint(0, 30, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, got = hf(tokens).logits, ours(tokens)
    assert (got - ref).abs().max().item() < 1e-4 and ref.std() > 0.1


@pytest.fixture(scope="module")
def torch_fine_tune(files, tmp_path_factory) -> dict[str, tuple[dict, Path]]:
    """One process, backend torch, init_from each checkpoint."""
    root, out = files[0], tmp_path_factory.mktemp("fine_tune")
    runs = {source: fine_tune_recipe(root, out / source, source) for source in ("hf", "mtp")}
    for raw in runs.values():
        train(config_from_dict(raw))
    return {source: (raw, Path(raw["out_dir"])) for source, raw in runs.items()}


def test_fine_tune_starts_at_transformers_loss_and_hands_off(files, torch_fine_tune):
    """init_from transformers' save_pretrained: step-0 loss equals transformers' (fp32; the routing
    reads the checkpoint's correction biases), and the handoff (biases moved) loads in transformers."""
    from .test_init_from import first_loss, hf_first_loss

    (root, hf), (raw, out) = files, torch_fine_tune["hf"]
    assert abs(first_loss(out) - hf_first_loss(raw, hf)) < TOL
    check_handoff(out, mtp=False)
    start, handoff = load_state_dict(root / "hf"), load_state_dict(out / "handoff")
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    steps = (handoff[bias] - start[bias]) / 0.001  # DeepSeek-V3's default rate, +-1 or 0 a step
    assert torch.allclose(steps, steps.round(), atol=1e-3) and 0 < steps.abs().max().round() <= FINE_TUNE_STEPS


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRAINER_RUNS))
def test_sharded_fine_tunes_train_like_one_process(runs, torch_fine_tune, name):
    """init_from a Baton checkpoint with an MTP module at torch3d dp=2 x ep=2 (meta-built; each rank's
    shards, the MTP module's and the biases read from the file) and at ZeRO-3 (partitioned from
    birth): the one-process run's losses and MTP losses (the balancing sums both ranks' loads; the
    first step's main loss is transformers', which ignores the module), handoffs with the module."""
    from .test_init_from import hf_first_loss

    (raw, single), out = torch_fine_tune["mtp"], runs["out"] / name
    hf = transformers.AutoModelForCausalLM.from_pretrained(raw["init_from"]).float().eval()
    got, want = records(out), records(single)
    assert len(got) == FINE_TUNE_STEPS and abs(want[0]["loss"] - hf_first_loss(raw, hf)) < TOL
    for key in ("loss", "mtp_loss"):
        assert max(abs(a[key] - b[key]) for a, b in zip(got, want)) < 1e-4, (key, got, want)
    check_handoff(out, mtp=True)


@pytest.fixture(scope="module")
def skewed(files) -> Path:
    """A Baton checkpoint whose MoE layer sends nearly every token to experts 0 and 1 of 8 (MaxVio ~2.6
    of at most 3): the embeddings share a component along channel 0 that those experts' router rows
    weigh heavily (the rows otherwise random enough that tokens differ in their choices)."""
    root, _ = files
    tok = Tokenizer.from_dir(root / "hf")
    model = build_model(dataclasses.replace(MODEL, vocab_size=tok.vocab_size, num_nextn_predict_layers=0), seed=0)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] += 0.1
        gate = model.model.layers[1].mlp.gate.weight
        gate.copy_(torch.randn(gate.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
        gate[:2, 0] += 1.0
    save_model(root / "skewed", model, tokenizer=tok)
    return root / "skewed"


BALANCING_STEPS = 25


@pytest.mark.slow
def test_bias_evens_out_a_skewed_router(files, skewed, tmp_path):
    """DeepSeek-V3's bias update in a real run: the skewed layer's MaxVio (max load / mean load - 1,
    logged every step) falls from ~2.6 to under 1/2.5 of it within 25 steps at rate 0.01; at rate 0
    the same run stays within 20% of where it started. (The learning rate is small, so that the
    gradients alone do not reshape the routing in 25 steps: the control shows they do not.)"""
    root, _ = files
    vio = {}
    for rate in (0.01, 0.0):
        raw = tiny_recipe(
            root,
            tmp_path / f"rate{rate}",
            init_from=skewed,
            micro_batch_size=32,
            global_batch_size=32,
            max_steps=BALANCING_STEPS,
            optim={"lr": 2e-5, "min_lr": 2e-5, "warmup_steps": 0},
            moe={"bias_update_rate": rate, "seq_aux_loss_coef": 0},
        )
        train(config_from_dict(raw))
        vio[rate] = [r["moe_max_violation"] for r in records(tmp_path / f"rate{rate}")]
    on, off = vio[0.01], vio[0.0]
    assert on[0] == off[0] > 2.0, (on[0], off[0])
    late_on, late_off = sum(on[-10:]) / 10, sum(off[-10:]) / 10
    assert late_on < on[0] / 2.5, on
    assert late_off > 0.8 * off[0], off


@pytest.mark.slow
def test_mtp_trains_hands_off_and_resumes(files, tmp_path):
    """`mtp: {num_layers: 1}` from scratch: the MTP loss (logged beside the main loss) falls with it;
    the handoff carries the module as model.layers.2.* (transformers loads the model without it,
    Baton with it); a run resumed at step 10 ends with the same weights, MTP and biases included."""
    root, _ = files
    drop = ("num_nextn_predict_layers", "bos_token_id", "eos_token_id", "pad_token_id")  # (mtp: and the tokenizer)
    model = {k: v for k, v in MODEL.to_dict().items() if k not in drop} | {"vocab_size": 72}
    raw = tiny_recipe(
        root,
        tmp_path / "run",
        model=model,
        mtp={"num_layers": 1, "loss_weight": 0.3},
        tokenizer={"path": str(root / "hf")},
        max_steps=20,
        export=True,
        checkpoint={"interval": 10},
        optim={"lr": 1e-2, "warmup_steps": 0},
    )
    train(config_from_dict(raw))
    recs = records(tmp_path / "run")
    main, mtp = [r["loss"] for r in recs], [r["mtp_loss"] for r in recs]
    assert sum(mtp[-3:]) / 3 < mtp[0] - 1.0 and sum(main[-3:]) / 3 < main[0] - 1.0, (main, mtp)
    check_handoff(tmp_path / "run", mtp=True)
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "run/checkpoints/step_00000010", tmp_path / "resumed/checkpoints/step_00000010")
    train(config_from_dict({**raw, "out_dir": str(tmp_path / "resumed")}))
    ends = [read_any(tmp_path / run / "checkpoints/step_00000020", "torch").weights for run in ("run", "resumed")]
    assert ends[0].keys() == ends[1].keys() and all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])


DEMO, ONE = {"preset": "demo"}, {"num_layers": 1}  # (a llama; one MTP module)


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"moe": {"aux_loss_coef": 0.01}}, "moe.aux_loss_coef 0.01 with deepseek_v3: Switch's"),
        ({"moe": {"z_loss_coef": 0.001}}, "moe.z_loss_coef 0.001 with deepseek_v3"),
        ({"model": {**DEMO, "num_local_experts": 4}, "moe": {"bias_update_rate": 1e-3}}, "needs its routed experts"),
        ({"model": DEMO, "moe": {"seq_aux_loss_coef": 0.1}}, "not model_type 'llama' without experts"),
        ({"precision": "fp16"}, "moe.seq_aux_loss_coef"),
        ({"precision": "fp16", "moe": {"seq_aux_loss_coef": 0}, "mtp": ONE}, "precision fp16 with 1 MTP module"),
        ({"backend": "megatron"}, "megatron-core GPTModel has no multi-head latent attention"),
        ({"backend": "torch3d", "parallel": {"tp": 2}}, "multi-head latent attention has"),
        ({"backend": "torch3d", "parallel": {"cp": 2}}, "values are narrower"),
        ({"backend": "torch3d", "parallel": {"pp": 2}, "mtp": ONE}, "parallel.pp 2 with 1 MTP module"),
        ({"early_exit": {"exit_layers": [2]}, "model": {"num_hidden_layers": 3}, "mtp": ONE}, "early_exit with 1 MTP"),
        ({"mtp": {"num_layers": 2, "loss_weight": -1}}, "mtp.loss_weight must be a number >= 0"),
        ({"model": DEMO, "mtp": {"num_layers": 1}}, "DeepSeek-V3's .model_type deepseek_v3., not 'llama'"),
        ({"model": DEMO, "mtp": {"loss_weight": 0.1}}, "the model has no MTP modules"),
        ({"model": {"num_nextn_predict_layers": 1}, "mtp": {"num_layers": 2}}, "mtp.num_layers 2 and model.num_ne"),
        ({"mtp": {"depth": 1}}, "unknown key.s. in mtp: depth"),
    ],
)
def test_bad_deepseek_recipes_fail_before_any_work(extra, match, tmp_path):
    """(`model` with a preset: that model; else MODEL without MTP modules, with those keys changed)"""
    model = extra.pop("model", {})
    mla = {k: v for k, v in MODEL.to_dict().items() if k != "num_nextn_predict_layers"}
    model = model if "preset" in model else {**mla, **model}
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"model": model, "data": {"seq_len": 32}, "out_dir": str(tmp_path), **extra})


def test_init_from_without_mtp_weights_trains_none_and_refuses_more(files, tmp_path):
    """transformers' config.json says num_nextn_predict_layers 1 without writing the module: the run
    has none, and asking for one is refused (there is nothing to start it from)."""
    root, _ = files
    cfg = config_from_dict(fine_tune_recipe(root, tmp_path / "a"))  # (source "hf")
    assert cfg.model_config(vocab_size=72).num_nextn_predict_layers == 0
    with pytest.raises(ConfigError, match="holds 0 MTP module.s. to start from"):
        config_from_dict(fine_tune_recipe(root, tmp_path / "b", mtp={"num_layers": 1}))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
