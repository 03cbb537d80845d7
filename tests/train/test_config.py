"""Every bad recipe fails with a clear message before any training work: nothing is built,
trained or written (the out_dir does not even appear) unless a later check needs data."""

import logging
import shutil
from pathlib import Path

import pytest
import yaml

from baton.common.checkpoint import save_model
from baton.common.cli import main
from baton.common.config import ConfigError, ModelConfig
from baton.common.model import build_model
from baton.common.tokenizer import train_char
from baton.train.backends.megatron import MegatronLayout
from baton.train.eagle import EagleTrainConfig
from baton.train.medusa import MedusaTrainConfig
from baton.train.parallel.layout import check_layout
from baton.train.recipe import config_from_dict, load_recipe
from baton.train.router import RouterTrainConfig
from baton.train.validate import validate

from .conftest import TINY


@pytest.mark.parametrize(
    "override, message",
    [
        (["bogus=1"], "unknown key(s) in training config: bogus"),
        (["deepspeed.stagee=2"], "unknown key(s) in deepspeed: stagee"),
        (["global_batch_size=10"], "global_batch_size 10 is not a multiple of micro_batch_size 4"),
        (["grad_accum_steps=3"], "global_batch_size 8 is not a multiple of micro_batch_size 4 x grad_accum_steps 3"),
        (["max_steps=0"], "max_steps must be a positive integer"),
        (["optim.warmup_steps=50"], "warmup_steps 50 must be in 0..max_steps 20"),
        (["data.path=/no/such/corpus.txt"], "no such file or directory"),
        (["data.seq_len=128"], "data.seq_len 128 exceeds the model's max_position_embeddings 64"),
        (["model.torch_dtype=bfloat16"], "training keeps float32 weights"),
        (["model.num_key_value_heads=3"], "must be divisible by num_key_value_heads"),
        (["backend=horovod"], "backend must be one of"),
        (["recompute.mode=partial"], "recompute.mode must be one of"),
        (["checkpoint.resume=/no/such/run"], "checkpoint.resume must be 'auto', 'never' or an existing"),
        (["checkpoint.keep_last=0"], "checkpoint.keep_last must be >= 1"),
        (["deepspeed.offload_optimizer=cpu"], "offload needs backend: deepspeed"),
        (["backend=deepspeed", "deepspeed.stage=4"], "deepspeed.stage must be 0, 1, 2 or 3"),
        (["backend=deepspeed", "deepspeed.offload_optimizer=disk"], "offload_optimizer must be one of"),
        (["backend=deepspeed", "deepspeed.stage=0", "deepspeed.offload_optimizer=cpu"], "needs ZeRO stage >= 1"),
        (["backend=deepspeed", "deepspeed.stage=2", "deepspeed.offload_param=cpu"], "offload_param needs ZeRO stage 3"),
        # DeepSpeed's trap: nvme optimizer offload at stage 1/2 silently offloads to CPU memory.
        (
            ["backend=deepspeed", "deepspeed.stage=2", "deepspeed.offload_optimizer=nvme", "deepspeed.nvme_path=/tmp"],
            "nvme needs ZeRO stage 3; at stage 1/2 DeepSpeed silently offloads to CPU",
        ),
        (["backend=deepspeed", "deepspeed.stage=3", "deepspeed.offload_optimizer=nvme"], "needs deepspeed.nvme_path"),
        (
            ["backend=deepspeed", "deepspeed.stage=2", "deepspeed.cpu_adam=true"],
            "cpu_adam runs the optimizer on the host",
        ),
        (
            ["backend=deepspeed", "deepspeed.extra={gradient_accumulation_steps: 4}"],
            "deepspeed.extra.gradient_accumulation_steps=4 disagrees with the recipe's 2 accumulation steps",
        ),
        (["parallel.tp=2"], "the parallel section needs backend: torch3d or megatron"),
        (["backend=megatron", "megatron.tp=2", "parallel.tp=4"], "megatron.tp 2 and parallel.tp 4 disagree"),
    ],
)
def test_bad_recipe_is_rejected_before_anything_happens(recipe, tmp_path, capsys, override, message):
    out = tmp_path / "run"
    assert main(["train", "--config", str(recipe), f"out_dir={out}", *override]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("baton train: error:")
    assert not out.exists()


def test_batch_arithmetic_is_checked_against_the_world_size():
    cfg = config_from_dict(TINY)  # global 8 = 4 micro x accum (derived) x ranks
    assert [cfg.accum_steps(n) for n in (1, 2)] == [2, 1]
    with pytest.raises(
        ConfigError, match="global_batch_size 8 is not divisible by micro_batch_size 4 x data-parallel size 3"
    ):
        validate(cfg, data_parallel_size=3)
    fixed = config_from_dict(TINY, ["grad_accum_steps=2"])
    with pytest.raises(
        ConfigError,
        match=r"global_batch_size 8 != micro_batch_size 4 x grad_accum_steps 2 x "
        r"data-parallel size 2 = 16",
    ):
        validate(fixed, data_parallel_size=2)


def test_nvme_offload_without_libaio_is_rejected_up_front(recipe, tmp_path, capsys, monkeypatch):
    from deepspeed.accelerator import get_accelerator

    # CI installs libaio, so make this machine one without it: the builder DeepSpeed would use says no
    builder = type(get_accelerator().create_op_builder("AsyncIOBuilder"))
    monkeypatch.setattr(builder, "is_compatible", lambda self, verbose=False: False)
    out = tmp_path / "run"
    args = [
        "backend=deepspeed",
        "deepspeed.stage=3",
        "deepspeed.offload_optimizer=nvme",
        f"deepspeed.nvme_path={tmp_path / 'nvme'}",
    ]
    assert main(["train", "--config", str(recipe), f"out_dir={out}", *args]) == 2
    assert (
        "async_io cannot be built on this machine (needs libaio: apt-get install libaio-dev)" in capsys.readouterr().err
    )
    assert not out.exists()


def test_resuming_with_another_global_batch_or_model_is_rejected(recipe, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--config", str(recipe), f"out_dir={out}", "max_steps=2", "export=false"]) == 0
    before = (out / "metrics.jsonl").read_text()
    assert main(["train", "--config", str(recipe), f"out_dir={out}", "global_batch_size=16"]) == 2
    assert "trained with a global batch of 8 samples, this run has 16" in capsys.readouterr().err
    assert main(["train", "--config", str(recipe), f"out_dir={out}", "model.hidden_size=48"]) == 2
    assert "the model differs from the checkpoint's in head_dim, hidden_size" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == before  # nothing trained, nothing rewritten


def test_too_little_data_for_one_global_batch(tmp_path, capsys):
    (tmp_path / "t.txt").write_text("To be, or not to be, that is the question. " * 3)
    raw = {**TINY, "data": {**TINY["data"], "path": str(tmp_path / "t.txt"), "cache_dir": str(tmp_path / "c")}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    assert main(["train", "--config", str(tmp_path / "r.yaml"), f"out_dir={tmp_path / 'run'}"]) == 2
    assert "fewer than one global batch of 8" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
    "recipe_file", sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml")), ids=lambda p: p.name
)
def test_every_shipped_recipe_is_valid(recipe_file, monkeypatch, tmp_path):
    monkeypatch.chdir(recipe_file.parents[1])  # data paths are relative to the repository root
    shakespeare = recipe_file.parents[2] / "shared" / "data" / "tinyshakespeare.txt"
    text = recipe_file.read_text()
    if "experts" in yaml.safe_load(text):
        pytest.skip("a `baton serve --coe` file, not a training recipe: tests/serve/test_coe.py loads it")
    if "tinyshakespeare" in text and not shakespeare.is_file():
        pytest.skip("../shared/data/tinyshakespeare.txt is not here")
    if "runs/demo/" in text:  # a recipe for the demo model (after `baton demo`, `baton distill`): stand-ins
        tok = train_char("a stand-in for the demo model's tokenizer")
        save_model(
            tmp_path / "demo" / "handoff",
            build_model(
                ModelConfig(
                    vocab_size=tok.vocab_size,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=4,  # the demo preset's depth (early-exit recipes exit inside it)
                    num_attention_heads=2,
                )
            ),
            tokenizer=tok,
        )
        shutil.copytree(tmp_path / "demo" / "handoff", tmp_path / "demo" / "pruned")  # `baton prune`'s output
        (tmp_path / "demo" / "distill.jsonl").write_text('{"text": "a stand-in continuation"}\n')
        (tmp_path / "router").mkdir()  # what `benchmarks/coe.py --write-prompts` writes for the router recipe
        (tmp_path / "router" / "prompts.jsonl").write_text(
            '{"text": "a stand-in prompt", "expert": "docs"}\n{"text": "another", "expert": "poet"}\n'
        )
        text = text.replace("runs/demo/", f"{tmp_path / 'demo'}/").replace("runs/router", str(tmp_path / "router"))
        recipe_file = tmp_path / recipe_file.name
        recipe_file.write_text(text)
    cfg = load_recipe(recipe_file)
    if isinstance(cfg, (MedusaTrainConfig, EagleTrainConfig)):  # heads for a frozen model, checked on construction
        demo = tmp_path / "demo"  # the heads train on what `baton distill` wrote
        assert (cfg.base, cfg.data.path) == (str(demo / "handoff"), str(demo / "distill.jsonl"))
        return
    if isinstance(cfg, RouterTrainConfig):  # a router over the frozen demo model, checked on construction
        assert (cfg.base, cfg.data) == (str(tmp_path / "demo" / "handoff"), str(tmp_path / "router" / "prompts.jsonl"))
        return
    validate(cfg, data_parallel_size=1)
    if cfg.backend == "deepspeed":  # the ZeRO recipes are meant for several ranks
        validate(cfg, data_parallel_size=2)
    assert cfg.out_dir.startswith("runs/")


def test_exponent_overrides_are_numbers():
    """YAML 1.1 reads 1e-3 (no dot) as a string; an override written that way is still a number."""
    cfg = config_from_dict(TINY, ["optim.lr=1e-3", "optim.min_lr=5E-5"])
    assert cfg.optim.lr == 1e-3 and cfg.optim.min_lr == 5e-5


# ------------------------------------------------------------- one layout section for every backend
@pytest.fixture
def world(monkeypatch):
    """The launcher's world size the layout checks read (as torchrun would set it)."""
    pytest.importorskip("megatron.core")  # backend megatron's checks need it

    def set_world(n: int) -> None:
        monkeypatch.setenv("WORLD_SIZE", str(n))
        monkeypatch.setenv("RANK", "0")

    return set_world


def test_megatron_takes_its_layout_from_the_parallel_section(world):
    world(2)
    cfg = config_from_dict(TINY, ["backend=megatron", "parallel.tp=2"])
    assert MegatronLayout.of(cfg) == MegatronLayout(tp=2, sequence_parallel=True)  # what the backend runs
    assert cfg.data_parallel_size(2) == 1
    off = config_from_dict(TINY, ["backend=megatron", "parallel.tp=2", "parallel.sequence_parallel=false"])
    assert MegatronLayout.of(off) == MegatronLayout(tp=2)


def test_one_key_switches_the_backend_and_keeps_the_layout(world):
    world(4)
    raw = {**TINY, "parallel": {"tp": 2, "pp": 2, "sequence_parallel": False}}
    torch3d, megatron = (config_from_dict(raw, [f"backend={b}"]) for b in ("torch3d", "megatron"))
    assert torch3d.parallel == megatron.parallel
    layout3d = check_layout(torch3d.parallel, torch3d.model_config(vocab_size=1024), 4, 2, 32)
    assert (layout3d.dp, layout3d.tp, layout3d.pp, layout3d.sequence_parallel) == (1, 2, 2, False)
    assert MegatronLayout.of(megatron) == MegatronLayout(tp=2, pp=2)
    for cfg in (torch3d, megatron):  # the same share of each global batch on every rank
        assert cfg.data_parallel_size(4) == 1 and [cfg.data_parallel_rank(r, 4) for r in range(4)] == [0] * 4


def test_the_old_megatron_layout_keys_read_as_before(world, caplog):
    """megatron.tp/pp/vp/sequence_parallel are deprecated names of the parallel section's keys,
    meaning what they did (sequence parallelism off unless asked for)."""
    world(2)
    with caplog.at_level(logging.WARNING, logger="baton.train.recipe"):
        old = config_from_dict(TINY, ["backend=megatron", "megatron.tp=2"])
    assert "megatron.tp is deprecated: read as parallel.tp" in caplog.text
    assert old == config_from_dict(TINY, ["backend=megatron", "parallel.tp=2", "parallel.sequence_parallel=false"])
    assert MegatronLayout.of(old) == MegatronLayout(tp=2)
    deep = ["backend=megatron", "model.num_hidden_layers=4", "megatron.pp=2", "megatron.vp=2"]
    interleaved = config_from_dict(TINY, deep)
    assert (interleaved.parallel.pp_stages_per_rank, interleaved.parallel.pp_schedule) == (2, "interleaved_1f1b")
    assert MegatronLayout.of(interleaved) == MegatronLayout(pp=2, vp=2)
    same = config_from_dict(TINY, ["backend=megatron", "megatron.tp=2", "parallel.tp=2"])  # agreeing: fine
    assert MegatronLayout.of(same).tp == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["megatron.tp=2", "parallel.tp=4"], "megatron.tp 2 and parallel.tp 4 disagree"),
        (["megatron.tp=2", "parallel.tp=1"], "megatron.tp 2 and parallel.tp 1 disagree"),  # set, if to the default
        (["megatron.vp=2", "parallel.pp_stages_per_rank=1"], "megatron.vp 2 and parallel.pp_stages_per_rank 1"),
        (
            ["megatron.sequence_parallel=true", "parallel.sequence_parallel=false"],
            "megatron.sequence_parallel True and parallel.sequence_parallel False disagree",
        ),
    ],
)
def test_an_old_megatron_key_that_contradicts_the_parallel_section_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        config_from_dict(TINY, ["backend=megatron", *overrides])
    assert "drop megatron." in str(e.value)
