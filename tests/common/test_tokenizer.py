import json
import random
import re
from pathlib import Path

import pytest
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from baton.common.corpus import build_corpus
from baton.common.tokenizer import Tokenizer, train_bpe, train_char

TINYSHAKESPEARE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tinyshakespeare.txt"

ROUND_TRIP = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "emoji 😀 family 👩‍👩‍👧‍👦 flag 🏳️‍🌈",
    "CJK 漢字かな交じり文 한국어",
    "combining marks e\u0301 a\u0308\u0323 \u0915\u094d\u0937",
    "NUL \x00 inside",
    "controls \x01\x07\x1b\x7f\x85\x9f",
    "mixed\r\nnew\rlines\n\n\u2028\u2029end\n",
    "tabs\tvertical\vform\ffeed",
    "\ufeffBOM, replacement \ufffd, noncharacter \uffff",
    "astral \U0010ffff \U0001d11e",
    "partial special <|endoftext",
    "spaces before punctuation , . ! ? 's n't 'm",  # transformers' clean-up would eat these
]
CHAR_EXTRA = "😀é漢\u0301\r\t"  # characters the char tokenizer learns beyond the corpus text


@pytest.fixture(scope="module")
def text() -> str:
    return build_corpus(max_bytes=150_000).decode()


@pytest.fixture(scope="module")
def bpe(text) -> Tokenizer:
    return train_bpe([text], vocab_size=400)


@pytest.fixture(scope="module")
def char(text) -> Tokenizer:
    return train_char(text + CHAR_EXTRA)


def random_unicode(n: int, seed: int = 0) -> str:
    """Any scalar value except surrogates, which are not valid UTF-8."""
    rng = random.Random(seed)
    points = (rng.choice([rng.randrange(0x80), rng.randrange(0x110000)]) for _ in range(n))
    return "".join(chr(p) for p in points if not 0xD800 <= p <= 0xDFFF)


def test_bpe_vocabulary_and_special_tokens(bpe):
    assert bpe.vocab_size == 400
    assert (bpe.eos_token_id, bpe.pad_token_id, bpe.bos_token_id) == (0, 1, None)
    assert bpe.token_to_id("<|endoftext|>") == 0 and bpe.token_to_id("<|pad|>") == 1
    vocab = bpe.hf.get_vocab()
    assert all(ch in vocab for ch in pre_tokenizers.ByteLevel.alphabet())  # every byte


@pytest.mark.parametrize("s", ROUND_TRIP + [random_unicode(3000)])
def test_bpe_round_trips_any_valid_text(bpe, s):
    ids = bpe.encode(s)
    assert bpe.decode(ids) == s
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.eos_token_id not in ids  # nothing special added implicitly


def test_encode_batch_matches_encode(bpe):
    assert bpe.encode_batch(ROUND_TRIP) == [bpe.encode(s) for s in ROUND_TRIP]


@pytest.mark.parametrize("s", ["😀", "漢", "é"])
def test_decoding_a_cut_character_gives_replacement_not_an_error(bpe, s):
    ids = bpe.encode(s)
    assert len(ids) == len(s.encode()), "precondition: the character is one token per byte"
    for k in range(1, len(ids)):
        assert bpe.decode(ids[:k]) == s.encode()[:k].decode("utf-8", errors="replace")
    assert bpe.decode(bpe.encode("ok ") + ids[:-1]) == "ok \ufffd"


def test_bpe_training_is_deterministic_and_depends_on_the_text(text, bpe):
    assert train_bpe([text], vocab_size=400).hf.to_str() == bpe.hf.to_str()
    assert train_bpe([text[: len(text) // 3]], vocab_size=400).hf.to_str() != bpe.hf.to_str()


def test_bpe_trains_from_files_line_by_line(tmp_path, text):
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    from_file = train_bpe([path], vocab_size=350)
    assert from_file.hf.to_str() == train_bpe(text.splitlines(keepends=True), vocab_size=350).hf.to_str()


def test_bpe_rejects_a_vocabulary_smaller_than_the_bytes(text):
    with pytest.raises(ValueError, match="vocab_size=200"):
        train_bpe([text], vocab_size=200)
    with pytest.raises(ValueError, match="special_tokens"):
        train_bpe([text], vocab_size=300, special_tokens=())


def test_char_tokenizer_is_one_token_per_character(text, char):
    chars = sorted(set(text + CHAR_EXTRA))
    assert char.vocab_size == 3 + len(chars)
    assert [char.token_to_id(t) for t in ("<|endoftext|>", "<|pad|>", "<|unk|>")] == [0, 1, 2]
    assert (char.eos_token_id, char.pad_token_id, char.bos_token_id) == (0, 1, None)
    sample = text[:5000] + "e\u0301 😀 漢 \r\n\t"
    ids = char.encode(sample)
    assert ids == [3 + chars.index(c) for c in sample]
    assert char.decode(ids) == sample


def test_char_tokenizer_maps_unseen_characters_to_unk(char):
    ids = char.encode("a\u2603b")  # a snowman, never seen
    assert ids == [char.token_to_id("a"), char.token_to_id("<|unk|>"), char.token_to_id("b")]
    assert char.decode(ids) == "a<|unk|>b"
    assert char.decode(ids, skip_special_tokens=True) == "ab"


def test_char_tokenizer_on_tinyshakespeare_has_nanogpt_vocabulary():
    if not TINYSHAKESPEARE.is_file():
        pytest.skip(f"shared data file absent: {TINYSHAKESPEARE}")
    tok = train_char(TINYSHAKESPEARE.read_text(encoding="utf-8"))
    assert tok.vocab_size == 65 + 3  # nanoGPT's shakespeare_char: 65 characters


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_saved_tokenizer_loads_in_transformers_with_the_same_ids(kind, request, tmp_path):
    ours = request.getfixturevalue(kind)
    theirs = AutoTokenizer.from_pretrained(ours.save(tmp_path / kind))
    assert isinstance(theirs, PreTrainedTokenizerFast)
    assert len(theirs) == ours.vocab_size
    assert (theirs.eos_token_id, theirs.pad_token_id) == (ours.eos_token_id, ours.pad_token_id)
    for s in ROUND_TRIP + ["The quick brown fox jumps over the lazy dog. " * 3]:
        ids = ours.encode(s)
        assert theirs(s)["input_ids"] == ids  # with transformers' default add_special_tokens
        assert theirs.decode(ids) == ours.decode(ids)


def test_from_dir_restores_the_same_tokenizer(bpe, tmp_path):
    loaded = Tokenizer.from_dir(bpe.save(tmp_path))
    assert loaded.hf.to_str() == bpe.hf.to_str()
    assert (loaded.eos_token, loaded.pad_token, loaded.bos_token) == (
        "<|endoftext|>",
        "<|pad|>",
        None,
    )
    assert loaded.encode(ROUND_TRIP[3]) == bpe.encode(ROUND_TRIP[3])


def test_from_file_without_config_finds_special_tokens_by_name(text, tmp_path):
    tok = train_bpe([text[:20_000]], vocab_size=300, special_tokens=("<s>", "</s>", "<unk>"))
    tok.hf.save(str(tmp_path / "tokenizer.json"))
    loaded = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert (loaded.eos_token, loaded.bos_token, loaded.unk_token) == ("</s>", "<s>", "<unk>")
    assert loaded.pad_token_id == loaded.eos_token_id == tok.token_to_id("</s>")


def test_from_file_reads_addedtoken_dicts_in_the_config(text, tmp_path):
    tok = train_bpe([text[:20_000]], vocab_size=300, special_tokens=("<|endoftext|>", "<|im_end|>"))
    tok.hf.save(str(tmp_path / "tokenizer.json"))
    config = {"eos_token": {"content": "<|im_end|>", "special": True}, "pad_token": "<|endoftext|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.eos_token_id == tok.token_to_id("<|im_end|>")
    assert loaded.pad_token_id == tok.token_to_id("<|endoftext|>")


def test_loading_errors_name_the_path_and_problem(text, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Tokenizer.from_dir(tmp_path / "nowhere")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json is not a valid tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    train_bpe([text[:20_000]], 300, special_tokens=("<|x|>",)).hf.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="no end-of-text token"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|missing|>"}')
    with pytest.raises(ValueError, match=re.escape("tokenizer.json: special token '<|missing|>' is not in")):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        Tokenizer.from_dir(tmp_path)
