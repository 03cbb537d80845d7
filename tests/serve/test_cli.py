"""`baton serve`/`generate` reach every engine option: one flag per field of EngineConfig,
SchedulerConfig and SpeculativeConfig (derived, or hand-written with a better name), and the value
given on the command line is the value the server's config holds."""

from __future__ import annotations

import dataclasses
import typing

import baton.serve.server as server_module
import pytest
from baton.common.cli import build_parser, main
from baton.common.flags import _scalar_type
from baton.serve.engine import EngineConfig
from baton.serve.parallel.config import ParallelConfig
from baton.serve.scheduling.scheduler import SchedulerConfig
from baton.serve.speculative import SpeculativeConfig

HAND = {"kv_cache_bytes": "--kv-cache-mb", "method": "--speculative"}  # fields whose flag has another unit/name


def _sample(typ: type, default):
    """A value unlike the default, of the field's type."""
    if typ is bool:
        return not default
    if typ is int:
        return (default or 0) + 3
    if typ is float:
        return (default or 0.0) + 0.25
    return {"preemption_mode": "swap", "policy": "priority", "kv_cache_dtype": "int8"}.get(typ, "x")


@pytest.fixture
def served(monkeypatch):
    seen = []
    monkeypatch.setattr(server_module, "run", lambda config: seen.append(config) or 0)
    return seen


def test_every_engine_field_has_a_serve_flag():
    options = {
        s
        for a in build_parser("serve")._subparsers._group_actions[0].choices["serve"]._actions
        for s in a.option_strings
    }
    for cls, prefix in ((EngineConfig, ""), (SchedulerConfig, ""), (SpeculativeConfig, "speculative-")):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if _scalar_type(hints[f.name]) is None:
                continue
            names = {HAND.get(f.name), "--" + f.name.replace("_", "-"), "--" + prefix + f.name.replace("_", "-")}
            assert names & options, f"{cls.__name__}.{f.name} has no baton serve flag"


def test_derived_flags_reach_the_config(served, tmp_path):
    argv = [
        "serve",
        "--model",
        str(tmp_path),
        "--max-num-batched-tokens",
        "96",
        "--no-enable-chunked-prefill",
        "--preemption-mode",
        "swap",
        "--no-enable-prefix-caching",
        "--streaming-sink-tokens",
        "4",
        "--streaming-window-tokens",
        "64",
        "--swap-space-bytes",
        "1024",
        "--kv-cache-mb",
        "8",
    ]
    assert main(argv) == 0
    e = served[0].engine
    assert (e.scheduler.max_num_batched_tokens, e.scheduler.enable_chunked_prefill, e.scheduler.preemption_mode) == (
        96,
        False,
        "swap",
    )
    assert (e.enable_prefix_caching, e.streaming_sink_tokens, e.streaming_window_tokens, e.swap_space_bytes) == (
        False,
        4,
        64,
        1024,
    )
    assert e.kv_cache_bytes == 8 * 2**20 and e.speculative is None
    assert (
        main(
            [
                "serve",
                "--model",
                str(tmp_path),
                "--speculative",
                "medusa",
                "--speculative-tree-width",
                "3",
                "--num-speculative-tokens",
                "5",
                "--speculative-adaptive",
                "--speculative-ngram-max",
                "6",
            ]
        )
        == 0
    )
    s = served[1].engine.speculative
    assert (s.method, s.tree_width, s.num_speculative_tokens, s.adaptive, s.ngram_max) == ("medusa", 3, 5, True, 6)


def test_unset_flags_keep_the_dataclass_defaults(served, tmp_path):
    assert main(["serve", "--model", str(tmp_path)]) == 0
    e = served[0].engine
    assert e.scheduler == SchedulerConfig()
    defaults = EngineConfig()
    for name in (
        "block_size",
        "kv_cache_fraction",
        "swap_space_bytes",
        "enable_prefix_caching",
        "max_model_len",
        "streaming_sink_tokens",
        "streaming_window_tokens",
        "kv_cache_dtype",
        "num_kv_blocks",
        "gpu_memory_utilization",
    ):
        assert getattr(e, name) == getattr(defaults, name), name
    assert e.parallel == ParallelConfig()


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--preemption-mode", "evict"], "preemption_mode"),
        (["--block-size", "0"], "block_size must be >= 1"),
        (["--kv-cache-fraction", "2"], "kv_cache_fraction"),
        (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
        (["--tensor-parallel-size", "0"], "tensor_parallel_size must be >= 1"),
        (["--moe-parallel", "data"], "moe_parallel"),
        (["--streaming-sink-tokens", "4"], "needs streaming_window"),
        (["--speculative", "ngram", "--speculative-tree-width", "0"], "tree_width"),
    ],
)
def test_a_bad_engine_setting_fails_before_serving(served, tmp_path, capsys, flags, words):
    assert main(["serve", "--model", str(tmp_path), *flags]) == 2
    assert words in capsys.readouterr().err and not served


@pytest.mark.parametrize(
    "flag, value, words",
    [
        ("--max-n", "0", "max_n must be >= 1"),
        ("--max-concurrent", "0", "max_concurrent must be >= 1"),
        ("--max-stop-strings", "-1", "max_stop_strings must be >= 0"),
        ("--max-prompt-tokens", "0", "max_prompt_tokens must be >= 1"),
    ],
)
def test_a_limit_that_admits_nothing_is_refused_before_the_port_binds(tmp_path, capsys, flag, value, words):
    assert main(["serve", "--model", str(tmp_path), "--port", "0", "--metrics-port", "-1", flag, value]) == 2
    err = capsys.readouterr().err
    assert words in err and "listening" not in err


def test_serve_help_lists_every_speculative_mode(capsys):
    from baton.serve.speculative import METHOD_HELP, METHODS

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = "".join(capsys.readouterr().out.split())  # (argparse wraps lines, also at hyphens)
    assert set(METHODS) == {"ngram", "draft", "medusa", "lookahead", "layerskip", "eagle", "mtp"}
    for method, words in METHOD_HELP.items():
        assert "".join(f"{method}: {words}".split()) in text, method


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Config-level checkpoints: plain, with 2 Medusa heads, with early exits, and another vocabulary."""
    from baton.common.checkpoint import save_model
    from baton.common.config import ModelConfig
    from baton.common.medusa import MedusaConfig, MedusaHeads, save_medusa
    from baton.common.model import build_model

    d = tmp_path_factory.mktemp("refusals")
    cfg = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    for name, extra in (("plain", {}), ("exits", {"early_exit_layers": [1]}), ("vocab50", {"vocab_size": 50})):
        save_model(d / name, build_model(ModelConfig(**{**cfg, **extra}), seed=0))
    save_model(d / "medusa", build_model(ModelConfig(**cfg), seed=0))
    save_medusa(MedusaHeads(MedusaConfig(32, 48, num_heads=2)), d / "medusa")
    return d


@pytest.mark.parametrize(
    "model, flags, words",
    [
        ("plain", ["--speculative", "medusa"], "has no Medusa heads"),
        ("medusa", ["--speculative", "medusa", "--speculative-tree-choices", "[[0],[0,0],[0,0,0]]"], "deeper than"),
        ("plain", ["--speculative", "draft", "--draft-model", "nonesuch"], "not a checkpoint directory"),
        ("plain", ["--speculative", "draft", "--draft-model", "vocab50"], "must share the target's tokenizer"),
        ("plain", ["--speculative", "layerskip"], "records no early exits"),
        ("plain", ["--speculative", "ngram", "--streaming-window-tokens", "64"], "StreamingLLM cannot be combined"),
        ("exits", ["--early-exit-threshold", "0.5", "--streaming-window-tokens", "64"], "combined with StreamingLLM"),
        ("exits", ["--early-exit-threshold", "0.5", "--speculative", "ngram"], "combined with speculative"),
        ("plain", ["--early-exit-threshold", "0.5"], "recorded early exits"),
    ],
)
def test_a_bad_speculative_or_early_exit_combination_is_refused_before_the_port_binds(
    checkpoints, served, capsys, model, flags, words
):
    flags = [str(checkpoints / f) if f in ("nonesuch", "vocab50") else f for f in flags]
    assert main(["serve", "--model", str(checkpoints / model), "--port", "0", *flags]) == 2
    assert words in capsys.readouterr().err and not served


@pytest.mark.parametrize(
    "model, flags",
    [
        ("medusa", ["--speculative", "medusa", "--speculative-tree-choices", "[[0],[1],[0,0]]"]),
        ("plain", ["--speculative", "draft", "--draft-model", "plain"]),
        ("exits", ["--speculative", "layerskip"]),
        ("exits", ["--early-exit-threshold", "0.5"]),
    ],
)
def test_the_same_checks_let_a_working_combination_through(checkpoints, served, model, flags):
    flags = [str(checkpoints / f) if f == "plain" else f for f in flags]
    assert main(["serve", "--model", str(checkpoints / model), *flags]) == 0 and len(served) == 1
