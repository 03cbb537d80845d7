"""The handoff format: atomic writes, sharding, validation, hashes, no unpickling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from baton.common.checkpoint import (
    INDEX_FILE,
    CheckpointError,
    HandoffMetadata,
    load_checkpoint,
    load_state_dict,
    read_metadata,
    save_model,
)
from baton.common.config import ModelConfig
from baton.common.model import build_model

CFG = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _model(seed=0, **kw):
    return build_model(ModelConfig(**{**CFG, **kw}), seed=seed)


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_save_load_round_trip_with_metadata(tmp_path):
    model = _model()
    meta = HandoffMetadata(producer="test", step=7, tokens_seen=1234, parallel_layout={"dp": 2, "tp": 1})
    save_model(tmp_path / "ckpt", model, metadata=meta)
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert _same(model, loaded.model)
    m = read_metadata(tmp_path / "ckpt")
    assert (m["step"], m["tokens_seen"], m["parallel_layout"], m["dtype"]) == (7, 1234, {"dp": 2, "tp": 1}, "float32")
    assert set(m["sha256"]) == {"config.json", "model.safetensors"}
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directory left behind"


def test_sharded_above_threshold(tmp_path):
    model = _model()
    save_model(tmp_path / "ckpt", model, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "ckpt" / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (tmp_path / "ckpt" / "model.safetensors").exists()
    assert _same(model, load_checkpoint(tmp_path / "ckpt").model)


def test_tied_embeddings_stored_once_and_retied(tmp_path):
    model = _model(tie_word_embeddings=True)
    save_model(tmp_path / "ckpt", model)
    assert "lm_head.weight" not in load_state_dict(tmp_path / "ckpt")
    loaded = load_checkpoint(tmp_path / "ckpt").model
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert _same(model, loaded)


def test_overwrite_replaces_previous(tmp_path):
    save_model(tmp_path / "ckpt", _model(seed=1))
    newer = _model(seed=2)
    save_model(tmp_path / "ckpt", newer)
    assert _same(newer, load_checkpoint(tmp_path / "ckpt").model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_exception_during_save_keeps_previous(tmp_path, monkeypatch):
    old = _model(seed=1)
    save_model(tmp_path / "ckpt", old)
    import baton.common.checkpoint as ck

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ck, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_model(tmp_path / "ckpt", _model(seed=2))
    assert _same(old, load_checkpoint(tmp_path / "ckpt").model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_process_killed_mid_write_keeps_previous(tmp_path):
    """A real process dies (os._exit) half-way through writing shards; the old checkpoint loads."""
    old = _model(seed=1)
    save_model(tmp_path / "ckpt", old)
    script = textwrap.dedent(f"""
        import os, torch
        import baton.common.checkpoint as ck
        from baton.common.config import ModelConfig
        from baton.common.model import build_model
        real, calls = ck.save_file, []
        def dying_save(tensors, path, metadata=None):
            calls.append(path)
            if len(calls) == 3:
                with open(path, "wb") as f:
                    f.write(b"half a file")
                os._exit(9)
            real(tensors, path, metadata=metadata)
        ck.save_file = dying_save
        ck.save_model({str(tmp_path / "ckpt")!r}, build_model(ModelConfig(**{CFG!r}), seed=2), max_shard_bytes=20_000)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    assert _same(old, load_checkpoint(tmp_path / "ckpt").model)
    save_model(tmp_path / "ckpt", old)  # the next save sweeps the dead writer's temporary dir
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_validation_names_first_mismatch(tmp_path):
    model = _model()
    sd = model.state_dict()
    bad = dict(sd)
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(5, 32)
    cfg = model.config
    from baton.common.checkpoint import save_checkpoint

    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*shape"):
        save_checkpoint(tmp_path / "a", cfg, bad)
    missing = {k: v for k, v in sd.items() if k != "model.norm.weight"}
    with pytest.raises(CheckpointError, match="missing tensor 'model.norm.weight'"):
        save_checkpoint(tmp_path / "b", cfg, missing)
    with pytest.raises(CheckpointError, match="unexpected tensor 'extra.weight'"):
        save_checkpoint(tmp_path / "c", cfg, {**sd, "extra.weight": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="dtype torch.float16"):
        save_checkpoint(tmp_path / "d", cfg, {k: v.half() for k, v in sd.items()})
    assert not any(tmp_path.iterdir()), "a rejected save must write nothing"


def test_load_detects_config_mismatch_and_corruption(tmp_path):
    save_model(tmp_path / "ckpt", _model())
    cfg_path = tmp_path / "ckpt" / "config.json"
    original = cfg_path.read_text()
    edited = json.loads(original)
    edited["intermediate_size"] = 64
    cfg_path.write_text(json.dumps(edited))
    with pytest.raises(CheckpointError, match="mlp.gate_proj.weight.*shape"):
        load_checkpoint(tmp_path / "ckpt", verify=False)
    with pytest.raises(CheckpointError, match="config.json does not match its sha256"):
        load_checkpoint(tmp_path / "ckpt")
    cfg_path.write_text(original)
    weights = tmp_path / "ckpt" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors does not match its sha256"):
        load_checkpoint(tmp_path / "ckpt")


def test_refuses_pickles_and_missing_dirs(tmp_path):
    d = tmp_path / "hfbin"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", **CFG}))
    torch.save({"x": torch.zeros(1)}, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin; pickled weights are never loaded"):
        load_checkpoint(d)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path / "empty")


def test_load_as_other_dtype(tmp_path):
    save_model(tmp_path / "ckpt", _model())
    m = load_checkpoint(tmp_path / "ckpt", dtype=torch.bfloat16).model
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    assert m.model.inv_freq.dtype == torch.float32
