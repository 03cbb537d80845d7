import json
import os
import random

import datasets
import huggingface_hub.constants
import pytest
import torch

from baton.common.corpus import default_corpus_text
from baton.common.tokenizer import Tokenizer, train_bpe, train_char
from baton.common.data import DataConfig, build_datasets, read_texts, torch_loader

WORDS = "the king said unto his daughter that all men must sleep ere morning comes again".split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        f"Doc {i}: " + " ".join(rng.choices(WORDS, k=rng.randrange(5, 40))) + rng.choice([".", "!\n", "?\n\n"])
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_bpe(make_docs(200, seed=99), vocab_size=300)


def write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def expected_blocks(tok: Tokenizer, docs: list[str], seq_len: int) -> list[list[int]]:
    """Independent expectation: every document's ids followed by EOS, cut every seq_len + 1."""
    stream = [i for d in docs for i in tok.encode(d) + [tok.eos_token_id]]
    n = seq_len + 1
    return [stream[k * n : (k + 1) * n] for k in range(len(stream) // n)]


def rows(ds: datasets.Dataset) -> list[list[int]]:
    return ds[:]["input_ids"]


def build(tmp_path, tok, **kw):
    kw.setdefault("cache_dir", str(tmp_path / "cache"))
    return build_datasets(DataConfig(**kw), tok)


def test_jsonl_documents_are_packed_into_the_eos_joined_stream(tmp_path, tok):
    docs = make_docs(60)
    train, val = build(tmp_path, tok, path=str(write_jsonl(tmp_path / "d.jsonl", docs)), seq_len=32, val_fraction=0)
    assert train.column_names == ["input_ids"]
    assert rows(train) == expected_blocks(tok, docs, 32)
    assert len(val) == 0


def test_a_text_file_is_one_document_not_one_per_line(tmp_path, tok):
    text = "\n".join(make_docs(40)) + "\n\n\nlast line\r\n"
    (tmp_path / "t.txt").write_text(text, newline="")
    train, _ = build(tmp_path, tok, path=str(tmp_path / "t.txt"), seq_len=16, val_fraction=0)
    assert rows(train) == expected_blocks(tok, [text], 16)


def test_a_directory_gives_text_files_then_json_files_in_sorted_order(tmp_path, tok):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    docs = make_docs(30)
    (root / "b.txt").write_text(docs[0])
    (root / "a.txt").write_text(docs[1])
    (root / "sub" / "c.txt").write_text(docs[2])
    records = [{"body": d, "other": 1} for d in docs[3:20]]
    records += [{"body": None, "other": 2}, {"body": "", "other": 3}]
    (root / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "e.json").write_text(json.dumps([{"body": d} for d in docs[20:]]))
    (root / "notes.md").write_text("ignored")
    train, _ = build(tmp_path, tok, path=str(root), text_field="body", seq_len=8, val_fraction=0)
    # Text files first, each one document; null and empty JSON bodies add nothing.
    order = [docs[1], docs[0], docs[2], *docs[3:]]
    assert rows(train) == expected_blocks(tok, order, 8)
    cfg = DataConfig(path=str(root), text_field="body", cache_dir=str(tmp_path / "cache"))
    assert read_texts(cfg) == order


def test_validation_split_is_seeded_and_loses_nothing(tmp_path, tok):
    path = str(write_jsonl(tmp_path / "d.jsonl", make_docs(80)))
    everything = expected_blocks(tok, make_docs(80), 16)
    train, val = build(tmp_path, tok, path=path, seq_len=16, val_fraction=0.1, seed=1)
    assert len(val) == round(0.1 * len(everything))
    assert sorted(rows(train) + rows(val)) == sorted(everything)
    again_train, again_val = build(tmp_path, tok, path=path, seq_len=16, val_fraction=0.1, seed=1)
    assert (rows(again_train), rows(again_val)) == (rows(train), rows(val))
    _, other_val = build(tmp_path, tok, path=path, seq_len=16, val_fraction=0.1, seed=2)
    assert rows(other_val) != rows(val)


def test_val_path_is_the_validation_set_and_all_of_path_trains(tmp_path, tok):
    train_docs, held_docs = make_docs(60, seed=1), make_docs(20, seed=2)
    path = str(write_jsonl(tmp_path / "train.jsonl", train_docs))
    (tmp_path / "held.txt").write_text(held_docs[0] + held_docs[1])  # a .txt file: one document
    # val_fraction is not used with a val_path (its default 0.05 would otherwise hold out blocks)
    train, val = build(tmp_path, tok, path=path, val_path=str(tmp_path / "held.txt"), seq_len=8)
    assert sorted(rows(train)) == sorted(expected_blocks(tok, train_docs, 8))
    assert rows(val) == expected_blocks(tok, [held_docs[0] + held_docs[1]], 8)


@pytest.mark.parametrize(
    "val_path,words",
    [("/no/such/held.txt", "DataConfig.val_path='/no/such/held.txt': no such file"), ("held.csv", "unsupported")],
)
def test_bad_val_path_is_refused_naming_it(tmp_path, val_path, words):
    if val_path == "held.csv":
        val_path = str(tmp_path / "held.csv")
        (tmp_path / "held.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=words):
        DataConfig(val_path=val_path)


def test_at_least_one_validation_block_when_there_are_two(tmp_path):
    tok = train_char("abcdefgh")
    (tmp_path / "t.txt").write_text("abcdefgh" * 2 + "a")  # 17 chars + EOS = 18 = two blocks of 9
    train, val = build(tmp_path, tok, path=str(tmp_path / "t.txt"), seq_len=8, val_fraction=0.01)
    assert (len(train), len(val)) == (1, 1)
    train, val = build(tmp_path, tok, path=str(tmp_path / "t.txt"), seq_len=10, val_fraction=0.5)
    assert (len(train), len(val)) == (1, 0)  # a single block stays in training


def test_too_little_text_for_one_block_is_a_clear_error(tmp_path, tok):
    (tmp_path / "t.txt").write_text("the king")
    with pytest.raises(ValueError, match="fewer than one block of seq_len \\+ 1 = 257"):
        build(tmp_path, tok, path=str(tmp_path / "t.txt"))


def test_second_call_is_served_from_the_cache_keyed_by_tokenizer_and_seq_len(tmp_path, tok, monkeypatch):
    path = str(write_jsonl(tmp_path / "d.jsonl", make_docs(50)))
    cache = tmp_path / "cache"
    first = build(tmp_path, tok, path=path, seq_len=16)
    assert len(list(cache.glob("baton-tokens-*.arrow"))) == 1
    assert len(list(cache.glob("baton-blocks-*.arrow"))) == 1

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again instead of using the cache")

    monkeypatch.setattr(Tokenizer, "encode_batch", no_tokenizing)
    second = build(tmp_path, tok, path=path, seq_len=16)
    assert [rows(ds) for ds in second] == [rows(ds) for ds in first]
    build(tmp_path, tok, path=path, seq_len=8)  # new blocks from the cached tokens
    assert len(list(cache.glob("baton-blocks-*.arrow"))) == 2
    with pytest.raises(AssertionError, match="tokenized again"):
        build(tmp_path, train_bpe(make_docs(200, seed=99), vocab_size=290), path=path, seq_len=16)


def test_editing_the_source_file_invalidates_the_cache(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, make_docs(30, seed=1))
    build(tmp_path, tok, path=str(path), seq_len=16)
    write_jsonl(path, make_docs(30, seed=2))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    train, val = build(tmp_path, tok, path=str(path), seq_len=16)
    assert sorted(rows(train) + rows(val)) == sorted(expected_blocks(tok, make_docs(30, seed=2), 16))


def test_no_path_means_the_embedded_default_corpus(tmp_path, tok, monkeypatch):
    monkeypatch.setenv("BATON_CACHE", str(tmp_path / "baton"))
    train, _ = build(tmp_path, tok, path=None, seq_len=64, val_fraction=0)
    text = default_corpus_text(tmp_path / "baton")
    assert len(text) > 500_000
    stream = tok.encode(text) + [tok.eos_token_id]
    assert len(train) == len(stream) // 65
    assert train[0]["input_ids"] == stream[:65]
    assert train[-1]["input_ids"] == stream[(len(train) - 1) * 65 : len(train) * 65]


def test_a_missing_json_field_is_a_clear_error(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(5), field="content")
    with pytest.raises(ValueError, match="has no 'text' field \\(DataConfig.text_field\\)"):
        build(tmp_path, tok, path=str(path))


def test_a_name_that_is_not_a_local_path_is_tried_on_the_hub(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # fail at once, no retries
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match="loaded as a Hugging Face Hub dataset name, and that failed"):
        build(tmp_path, tok, path="nobody/no-such-dataset")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"seq_len": 1}, "seq_len"),
        ({"seq_len": 8.0}, "seq_len"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"val_fraction": -0.1}, "val_fraction"),
        ({"text_field": ""}, "text_field"),
        ({"path": "./missing.txt"}, "path='./missing.txt': no such file"),
        ({"path": "missing.jsonl"}, "path='missing.jsonl': no such file"),
        ({"path": "~/no/such/dir"}, "path='~/no/such/dir': no such file"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"DataConfig.{field}"):
        DataConfig(**kwargs)


def test_unsupported_file_type_is_rejected(tmp_path):
    (tmp_path / "d.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        DataConfig(path=str(tmp_path / "d.csv"))


def test_torch_loader_is_a_seeded_resumable_epoch(tmp_path, tok):
    train, _ = build(
        tmp_path,
        tok,
        path=str(write_jsonl(tmp_path / "d.jsonl", make_docs(40))),
        seq_len=16,
        val_fraction=0,
    )
    blocks = torch.tensor(rows(train))
    batches = list(torch_loader(train, batch_size=5, seed=3))
    assert all(b.dtype == torch.int64 and b.shape[1] == 17 for b in batches)
    assert [len(b) for b in batches] == [5] * (len(blocks) // 5) + ([len(blocks) % 5] if len(blocks) % 5 else [])
    epoch = torch.cat(batches)
    assert sorted(epoch.tolist()) == sorted(blocks.tolist())  # each sample exactly once
    assert torch.equal(torch.cat(list(torch_loader(train, 5, seed=3))), epoch)
    assert not torch.equal(torch.cat(list(torch_loader(train, 5, seed=4))), epoch)
    assert torch.equal(torch.cat(list(torch_loader(train, 5, seed=3, start_index=7))), epoch[7:])
    assert torch.equal(torch.cat(list(torch_loader(train, 4, seed=0, shuffle=False))), blocks)


def test_given_token_ids_are_used_as_they_are_not_re_encoded(tmp_path, tok, monkeypatch):
    """A distilled corpus carries the model's own ids: ids the tokenizer would never produce for the
    text (each character on its own, reversed; EOS in mid-document) must come through unchanged."""
    docs = make_docs(40)
    given = [list(reversed(tok.encode(" ".join(d)))) + [tok.eos_token_id, 7] for d in docs]
    assert all(ids != tok.encode(d) for ids, d in zip(given, docs))
    path = tmp_path / "distilled.jsonl"
    path.write_text("".join(json.dumps({"text": d, "token_ids": ids}) + "\n" for d, ids in zip(docs, given)))
    train, _ = build(tmp_path, tok, path=str(path), seq_len=16, val_fraction=0)
    stream = [i for ids in given for i in ids + [tok.eos_token_id]]
    assert rows(train) == [stream[k * 17 : (k + 1) * 17] for k in range(len(stream) // 17)]

    # The same file without using the ids (another ids_field) is a different cache entry: the text, encoded.
    text_train, _ = build(tmp_path, tok, path=str(path), seq_len=16, val_fraction=0, ids_field="none")
    assert rows(text_train) == expected_blocks(tok, docs, 16)
    assert len(list((tmp_path / "cache").glob("baton-tokens-*.arrow"))) == 2
    monkeypatch.setattr(Tokenizer, "encode_batch", lambda *a, **k: pytest.fail("encoded given ids' text"))
    again, _ = build(tmp_path, tok, path=str(path), seq_len=16, val_fraction=0)
    assert rows(again) == rows(train)


def test_a_directory_mixes_given_ids_and_text_to_encode(tmp_path, tok):
    root = tmp_path / "corpus"
    root.mkdir()
    docs = make_docs(30)
    (root / "a.txt").write_text(docs[0])
    records = [{"text": docs[1], "token_ids": [5, 6, 7]}, {"text": docs[2], "token_ids": None}, {"text": docs[3]}]
    (root / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "c.json").write_text(json.dumps([{"text": d} for d in docs[4:]]))
    train, _ = build(tmp_path, tok, path=str(root), seq_len=8, val_fraction=0)
    stream = [i for d in docs[:1] for i in tok.encode(d) + [tok.eos_token_id]] + [5, 6, 7, tok.eos_token_id]
    stream += [i for d in docs[2:] for i in tok.encode(d) + [tok.eos_token_id]]
    assert rows(train) == [stream[k * 9 : (k + 1) * 9] for k in range(len(stream) // 9)]


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([1, 2, 300], "holds ids in 1..300, outside the tokenizer's vocabulary 0..299"),
        ([-1, 2], "holds ids in -1..5, outside"),
        ([1.5, 2], "must hold lists of integer token ids"),
        (["a", "b"], "must hold lists of integer token ids"),
        (3, "must hold lists of integer token ids"),
    ],
)
def test_bad_given_ids_are_a_clear_error_naming_the_file(tmp_path, tok, ids, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps({"text": "the king", "token_ids": [4, 5]})
        + "\n"
        + json.dumps({"text": "said", "token_ids": ids})
        + "\n"
    )
    with pytest.raises(ValueError, match=f"{path}: 'token_ids' \\(DataConfig.ids_field\\) {message}"):
        build(tmp_path, tok, path=str(path), seq_len=4)
