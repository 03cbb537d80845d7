"""Training data: text -> tokens -> fixed-length blocks, through Hugging Face `datasets`.

Documents are tokenized and joined into one stream with the end-of-text token after each, and
the stream is cut into blocks of seq_len + 1 tokens (inputs are block[:-1], targets block[1:]);
the ragged tail is dropped. Blocks are split into train and validation by a seeded shuffle.
JSON records that carry token ids (`ids_field`, as `baton distill` writes them) are used as those
ids, not re-encoded: a decode -> encode round trip may not give back the ids a model produced.
The tokenized and packed tables are cached under `cache_dir`, keyed by the source data, the
tokenizer's whole tokenizer.json and seq_len, so a second run with the same inputs is fast.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from baton.common.corpus import cache_root, default_corpus_path
from baton.common.tokenizer import Tokenizer

log = logging.getLogger(__name__)

BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json"}  # file suffix -> datasets builder
IDS = datasets.Sequence(datasets.Value("int32"))  # a document's token ids
PIPELINE_VERSION = 1  # bump when tokenizing or packing changes, so old caches are not reused


@dataclass
class DataConfig:
    """Where the text comes from and how it is cut into training blocks.

    `path`: a .txt file (one document per file), a .json/.jsonl file with a `text_field`, a
    directory of such files, None for the embedded default corpus (see baton.common.corpus),
    or otherwise a Hugging Face Hub dataset name (needs network access).
    `ids_field`: in .json/.jsonl files that have it, each record's token ids, used as they are
    (plus EOS) instead of encoding its text; records where it is null are encoded.
    `val_path`: a separate held-out file or directory (same kinds as `path`): its blocks are the
    validation set and every block of `path` trains; `val_fraction` is then not used.
    `cache_dir`: where `datasets` keeps its caches; default `<baton cache root>/datasets`.
    """

    path: str | None = None
    text_field: str = "text"
    ids_field: str = "token_ids"
    seq_len: int = 256
    val_fraction: float = 0.05
    seed: int = 1234
    cache_dir: str | None = None
    val_path: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise ValueError(f"DataConfig.seq_len must be an integer >= 2, got {self.seq_len!r}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"DataConfig.val_fraction must be in [0, 1), got {self.val_fraction!r}")
        for name in ("text_field", "ids_field"):
            if not getattr(self, name):
                raise ValueError(f"DataConfig.{name} must be a non-empty field name")
        for name in ("path", "val_path"):
            if getattr(self, name) is not None:
                _check_source(name, getattr(self, name))


def _check_source(name: str, path: str) -> None:
    local = Path(path).expanduser()
    if not local.exists():
        if _looks_local(path):
            raise ValueError(f"DataConfig.{name}={path!r}: no such file or directory")
    elif local.is_file() and local.suffix not in BUILDERS:
        raise ValueError(
            f"DataConfig.{name}={path!r}: unsupported file type {local.suffix!r}; "
            f"use {', '.join(BUILDERS)} or a directory of such files"
        )


def _looks_local(path: str) -> bool:
    """Whether a path that does not exist was meant as a local one rather than a Hub name."""
    return path.startswith(("/", ".", "~")) or "\\" in path or Path(path).suffix in BUILDERS


def build_datasets(cfg: DataConfig, tokenizer: Tokenizer) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Train and validation datasets with one column, `input_ids`: lists of seq_len + 1 ids."""
    if cfg.val_path is None:
        return _split(cfg, tokenizer)
    log.info("Validation blocks come from data.val_path %s; all of the training data trains", cfg.val_path)
    train, _ = _split(replace(cfg, val_path=None, val_fraction=0), tokenizer)
    val, _ = _split(replace(cfg, path=cfg.val_path, val_path=None, val_fraction=0), tokenizer)
    return train, val


def _split(cfg: DataConfig, tokenizer: Tokenizer) -> tuple[datasets.Dataset, datasets.Dataset]:
    """`cfg.path` tokenized (cached), packed into blocks and split by `val_fraction`."""
    cache = _cache_dir(cfg)
    source = cfg.path if cfg.path is not None else "the default corpus"
    docs = _load_documents(cfg, str(cache), tokenizer.vocab_size)
    ids_field = cfg.ids_field if "ids" in docs.column_names else None

    # docs._fingerprint is datasets' own hash of the source (files, their modification times,
    # builder options); the tokenizer enters by its full serialized form, and whether (which)
    # given ids are used instead of encoding.
    tokens_key = _hash(PIPELINE_VERSION, docs._fingerprint, tokenizer.hf.to_str(), tokenizer.eos_token, ids_field)
    tokens_file = cache / f"baton-tokens-{tokens_key}.arrow"
    if tokens_file.exists():
        log.info("Reusing the tokens of %s cached in %s", source, tokens_file)
    else:
        log.info(
            "Tokenizing %s (%d documents%s) with a %d-token vocabulary",
            source,
            len(docs),
            f"; the ids in {ids_field!r} where given" if ids_field else "",
            tokenizer.vocab_size,
        )
    tokens = docs.map(
        partial(_tokenize, tokenizer=tokenizer),
        batched=True,
        remove_columns=docs.column_names,
        features=datasets.Features({"ids": datasets.Sequence(datasets.Value("int32"))}),
        cache_file_name=str(tokens_file),
        new_fingerprint=tokens_key,
        desc="Tokenizing",
    )

    block = cfg.seq_len + 1
    n_tokens = pc.sum(pc.list_value_length(tokens.data.column("ids"))).as_py() or 0
    if n_tokens < block:
        raise ValueError(
            f"{source} tokenizes to {n_tokens} tokens, fewer than one block of "
            f"seq_len + 1 = {block}; use more text or a smaller DataConfig.seq_len"
        )
    blocks_key = _hash(tokens_key, block)
    blocks = (
        tokens.with_format("arrow")
        .map(
            partial(_pack, block=block),
            batched=True,
            batch_size=None,  # the whole stream at once, so only the final tail is dropped
            remove_columns=["ids"],
            cache_file_name=str(cache / f"baton-blocks-{blocks_key}.arrow"),
            new_fingerprint=blocks_key,
            desc="Packing",
        )
        .with_format(None)
    )

    n = len(blocks)
    n_val = 0 if cfg.val_fraction == 0 or n < 2 else min(n - 1, max(1, round(n * cfg.val_fraction)))
    if cfg.val_fraction > 0 and n_val == 0:
        log.warning("Only one block of %d tokens: the validation set is empty", block)
    order = np.random.default_rng(cfg.seed).permutation(n)
    train, val = blocks.select(np.sort(order[n_val:])), blocks.select(np.sort(order[:n_val]))
    log.info(
        "%s: %d tokens make %d blocks of %d tokens (%d tail tokens dropped): %d for training, %d for validation",
        source,
        n_tokens,
        n,
        block,
        n_tokens - n * block,
        len(train),
        len(val),
    )
    return train, val


def read_texts(cfg: DataConfig) -> list[str]:
    """The non-empty documents `build_datasets` would tokenize, e.g. to train a tokenizer on."""
    return [t for t in _load_documents(cfg, str(_cache_dir(cfg)))["text"] if t]


def _cache_dir(cfg: DataConfig) -> Path:
    cache = Path(cfg.cache_dir) if cfg.cache_dir is not None else cache_root() / "datasets"
    cache.mkdir(parents=True, exist_ok=True)
    return cache


def _load_documents(cfg: DataConfig, cache: str, vocab_size: int | None = None) -> datasets.Dataset:
    """One row per document, in a column "text"; given a vocab_size (to check them against), JSON
    files' `ids_field` too, as a column "ids" (null where a record, or a whole file, has none)."""
    if cfg.path is None:
        files = [default_corpus_path()]
    else:
        local = Path(cfg.path).expanduser()
        if not local.exists():
            return _load_hub(cfg, cache)
        files = [local]
        if local.is_dir():
            files = sorted(f for f in local.rglob("*") if f.suffix in BUILDERS and f.is_file())
            if not files:
                raise ValueError(f"DataConfig.path={cfg.path!r}: no .txt, .json or .jsonl files in it")
    parts = []
    for builder in ("text", "json"):  # a directory may hold both; text files come first
        group = [str(f) for f in files if BUILDERS[f.suffix] == builder]
        if not group:
            continue
        # sample_by="document": a whole .txt file is one document, not one per line.
        options = {"sample_by": "document"} if builder == "text" else {}
        ds = datasets.load_dataset(builder, data_files=group, split="train", cache_dir=cache, **options)
        where = ", ".join(group)
        if builder == "json" and vocab_size is not None and cfg.ids_field in ds.column_names:
            ds = _text_column(ds, cfg.text_field, where, keep=cfg.ids_field)
            parts.append(_ids_column(ds, cfg.ids_field, where, vocab_size))
        else:
            parts.append(_text_column(ds, "text" if builder == "text" else cfg.text_field, where))
    if any("ids" in p.column_names for p in parts):  # the text files of a mixed directory
        parts = [p if "ids" in p.column_names else p.add_column("ids", [None] * len(p), feature=IDS) for p in parts]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _load_hub(cfg: DataConfig, cache: str) -> datasets.Dataset:
    try:
        ds = datasets.load_dataset(cfg.path, split="train", cache_dir=cache)
    except Exception as e:
        raise RuntimeError(
            f"DataConfig.path={cfg.path!r} is not an existing local file or directory, so it "
            f"was loaded as a Hugging Face Hub dataset name, and that failed (is this machine "
            f"offline?): {e}"
        ) from e
    return _text_column(ds, cfg.text_field, cfg.path)


def _text_column(ds: datasets.Dataset, field: str, where: str, keep: str | None = None) -> datasets.Dataset:
    """The `field` column as "text" (and the `keep` column beside it)."""
    if field not in ds.column_names:
        raise ValueError(f"{where} has no {field!r} field (DataConfig.text_field); it has {ds.column_names}")
    ds = ds.select_columns([field] if keep is None else [field, keep])
    return ds if field == "text" else ds.rename_column(field, "text")


def _ids_column(ds: datasets.Dataset, field: str, where: str, vocab_size: int) -> datasets.Dataset:
    """`field` renamed "ids", checked first: lists of integer ids in 0..vocab_size - 1."""
    column = ds.data.column(field)
    kind = column.type
    if pa.types.is_null(kind):  # null in every record: nothing given
        return ds.rename_column(field, "ids").cast_column("ids", IDS)
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(kind.value_type):
        raise ValueError(f"{where}: {field!r} (DataConfig.ids_field) must hold lists of integer token ids, not {kind}")
    low, high = (v.as_py() for v in pc.min_max(pc.list_flatten(column)).values())
    if low is not None and (low < 0 or high >= vocab_size):
        raise ValueError(
            f"{where}: {field!r} (DataConfig.ids_field) holds ids in {low}..{high}, outside the "
            f"tokenizer's vocabulary 0..{vocab_size - 1}"
        )
    return ds.rename_column(field, "ids").cast_column("ids", IDS)


def _tokenize(batch: dict[str, list], tokenizer: Tokenizer) -> dict[str, list[list[int]]]:
    """Each document's given ids (else its encoded text) + EOS; empty or null ones add nothing."""
    texts = batch["text"]
    given = batch.get("ids") or [None] * len(texts)
    encoded = iter(tokenizer.encode_batch([t for t, g in zip(texts, given) if g is None and t]))
    out = []
    for text, ids in zip(texts, given):
        if ids is None:
            ids = next(encoded) if text else []
        if ids:
            out.append(ids + [tokenizer.eos_token_id])
    return {"ids": out}


def _pack(table: pa.Table, block: int) -> pa.Table:
    """Concatenate every document's ids and cut them into rows of `block` ids."""
    stream = pc.list_flatten(table.column("ids")).combine_chunks()
    n = len(stream) // block
    return pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(stream.slice(0, n * block), block)})


def _hash(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:16]


def torch_loader(
    ds: datasets.Dataset,
    batch_size: int,
    seed: int,
    shuffle: bool = True,
    start_index: int = 0,
) -> Iterator[torch.Tensor]:
    """Yield one epoch of int64 batches [batch_size, seq_len + 1]; the last may be shorter.

    The order depends only on `seed` (use a new one per epoch, e.g. seed + epoch), so a
    resumed run passes `start_index`, the number of samples already seen this epoch,
    and continues exactly where it stopped.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if shuffle:
        order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))
    else:
        order = torch.arange(len(ds))
    rows = ds.with_format("torch", columns=["input_ids"])
    for i in range(start_index, len(ds), batch_size):
        yield rows[order[i : i + batch_size].tolist()]["input_ids"].long()
