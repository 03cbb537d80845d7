"""What a run trains on - the data, the tokenizer, the block length, the seeds - recorded in every
checkpoint and compared on resume.

A resumed run continues the checkpoint's data order (a position in a seeded shuffle of its blocks);
with other data, another tokenizer, seq_len or seed, the same position means other samples, and
the run would quietly train on a mixture. So a difference is refused, naming it, unless the user
says it is meant (--allow-resume-mismatch / checkpoint.allow_resume_mismatch=true), which warns.

The data's identity is content, not its path, so a dataset copied elsewhere (e.g. to node-local
scratch) still resumes: the file names relative to data.path, their sizes, and the first MiB.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from baton.common.config import ConfigError
from baton.common.corpus import default_corpus_path
from baton.common.data import BUILDERS, DataConfig
from baton.common.tokenizer import Tokenizer
from baton.train.config import TrainConfig

log = logging.getLogger(__name__)

HEAD_BYTES = 1 << 20
OVERRIDE = "pass --allow-resume-mismatch (or checkpoint.allow_resume_mismatch=true) to resume anyway"


def data_files(cfg: DataConfig) -> tuple[Path, list[Path]] | None:
    """The root and the files the data pipeline reads (None: a Hub dataset, known by name only)."""
    if cfg.path is None:
        path = default_corpus_path()
        return path.parent, [path]
    local = Path(cfg.path).expanduser()
    if not local.exists():
        return None
    if local.is_file():
        return local.parent, [local]
    return local, sorted(f for f in local.rglob("*") if f.suffix in BUILDERS and f.is_file())


def data_fingerprint(cfg: DataConfig) -> dict[str, Any] | None:
    """Files, bytes, and a hash of their relative names, sizes and first MiB (not mtimes: a copy keeps it)."""
    found = data_files(cfg)
    if found is None:
        return None
    root, files = found
    h, total, budget = hashlib.sha256(), 0, HEAD_BYTES
    for f in files:
        size = f.stat().st_size
        total += size
        h.update(f"{f.relative_to(root).as_posix()}\0{size}\0".encode())
    for f in files:
        if budget <= 0:
            break
        with open(f, "rb") as fh:
            head = fh.read(budget)
        h.update(head)
        budget -= len(head)
    return {"files": len(files), "bytes": total, "sha256": h.hexdigest()[:16]}


def tokenizer_id(tok: Tokenizer) -> str:
    """A hash of the whole tokenizer (vocabulary, merges, normalisation) and its special tokens."""
    special = "\0".join(str(t) for t in (tok.eos_token, tok.pad_token, tok.bos_token, tok.unk_token))
    return hashlib.sha256(f"{tok.hf.to_str()}\0{special}".encode()).hexdigest()[:16]


def describe(cfg: TrainConfig) -> dict[str, Any]:
    """What this run trains on, as recorded in trainer_state.json ("inputs"); the tokenizer's hash
    is added once the tokenizer is known (see with_tokenizer)."""
    d, t = cfg.data, cfg.tokenizer
    return {
        "data": {
            "path": d.path,
            "fingerprint": data_fingerprint(d),
            "text_field": d.text_field,
            "seq_len": d.seq_len,
            "val_fraction": d.val_fraction,
            "seed": d.seed,
            "val_path": d.val_path,
            "val_fingerprint": data_fingerprint(replace(d, path=d.val_path)) if d.val_path is not None else None,
        },
        "tokenizer": {
            "path": t.path,
            "kind": t.kind,
            "vocab_size": t.vocab_size,
            "sha256": tokenizer_id(Tokenizer.from_dir(t.path)) if t.path else None,
        },
        "seed": cfg.seed,
    }


def with_tokenizer(inputs: dict[str, Any], tok: Tokenizer) -> dict[str, Any]:
    return {**inputs, "tokenizer": {**inputs["tokenizer"], "sha256": tokenizer_id(tok)}}


def _describe_data(path: Any, fp: dict[str, Any] | None) -> str:
    where = "the default corpus" if path is None else str(path)
    return where if fp is None else f"{where} ({fp['files']} file(s), {fp['bytes']:,} bytes, sha256 {fp['sha256']})"


def _describe_held_out(path: Any, fp: dict[str, Any] | None) -> str:
    return "none (val_fraction of data.path)" if path is None else _describe_data(path, fp)


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """How `now` (describe()) differs from a checkpoint's recorded inputs, one phrase each."""
    out = []
    was, cur = saved["data"], now["data"]
    if was["fingerprint"] is None or cur["fingerprint"] is None:  # a Hub dataset: its name is all we know
        if was["path"] != cur["path"]:
            out.append(f"data.path was {was['path']} in the checkpoint, is {cur['path']} now")
    elif was["fingerprint"] != cur["fingerprint"]:
        what = "data.path" if was["path"] != cur["path"] else "the data at data.path (changed since the checkpoint)"
        out.append(
            f"{what} was {_describe_data(was['path'], was['fingerprint'])} in the checkpoint, is "
            f"{_describe_data(cur['path'], cur['fingerprint'])} now"
        )
    for key in ("seq_len", "text_field", "val_fraction", "seed"):
        if was[key] != cur[key]:
            out.append(f"data.{key} was {was[key]!r} in the checkpoint, is {cur[key]!r} now")
    # The held-out file, known by content as data.path is (checkpoints written before data.val_path
    # existed have neither key: there was none then).
    was_val, cur_val = (was.get("val_path"), was.get("val_fingerprint")), (cur["val_path"], cur["val_fingerprint"])
    same_val = was_val[1] == cur_val[1] if None not in (was_val[1], cur_val[1]) else was_val[0] == cur_val[0]
    if not same_val:
        out.append(
            f"data.val_path was {_describe_held_out(*was_val)} in the checkpoint, is {_describe_held_out(*cur_val)} now"
        )
    was_t, cur_t = saved["tokenizer"], now["tokenizer"]
    if cur_t["path"] is not None and cur_t["sha256"] != was_t["sha256"]:
        out.append(
            f"tokenizer.path {cur_t['path']} holds another tokenizer (sha256 {cur_t['sha256']}) than the "
            f"checkpoint's (sha256 {was_t['sha256']}"
            + (f", from {was_t['path']}" if was_t["path"] else "")
            + "; a resumed run keeps the checkpoint's)"
        )
    elif cur_t["path"] is None and was_t["path"] is None:  # both trained one on the data
        for key in ("kind", "vocab_size"):
            if was_t[key] != cur_t[key]:
                out.append(f"tokenizer.{key} was {was_t[key]!r} in the checkpoint, is {cur_t[key]!r} now")
    if saved["seed"] != now["seed"]:
        out.append(f"seed was {saved['seed']!r} in the checkpoint, is {now['seed']!r} now (it orders the data)")
    return out


def check_resume_inputs(
    state: dict[str, Any], path: Path, cfg: TrainConfig, inputs: dict[str, Any], main: bool
) -> None:
    """Refuse (or, when allowed, warn about) resuming `path` on other inputs than it was trained on."""
    saved = state.get("inputs")
    if saved is None:
        if main:
            log.warning(
                "%s records no inputs (an older checkpoint): cannot check that the data, tokenizer and "
                "seq_len are the ones it was trained on",
                path,
            )
        return
    diff = differences(saved, inputs)
    if not diff:
        return
    if not cfg.checkpoint.allow_resume_mismatch:
        raise ConfigError(f"resume {path}: {'; '.join(diff)}; {OVERRIDE}")
    if main:
        for d in diff:
            log.warning("resume %s anyway (allow_resume_mismatch): %s", path, d)
