"""Tokenizers for Baton: byte-level BPE and character-level, over Hugging Face `tokenizers`.

The trainer and the server only need ids, a few special-token ids and a directory format.
`Tokenizer.save` writes `tokenizer.json` plus `tokenizer_config.json`, so the same directory
also loads with `transformers.AutoTokenizer` and gives the same ids.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

DEFAULT_SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>")
UNK_TOKEN = "<|unk|>"

# Names that well-known tokenizers give their special tokens, tried in order when a
# tokenizer.json comes without a tokenizer_config.json that names them.
# (GPT-2/NeoX, Llama 2/Mistral, Gemma, Llama 3.)
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
PAD_NAMES = ("<|pad|>", "<pad>")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")
UNK_NAMES = (UNK_TOKEN, "<unk>")


@dataclass
class Tokenizer:
    """A `tokenizers.Tokenizer` plus the names of its special tokens.

    `pad_token` falls back to the end-of-text token, as is usual for causal LMs.
    """

    hf: HFTokenizer
    eos_token: str
    pad_token: str
    bos_token: str | None = None
    unk_token: str | None = None

    def __post_init__(self) -> None:
        for name in (self.eos_token, self.pad_token, self.bos_token, self.unk_token):
            if name is not None and self.hf.token_to_id(name) is None:
                raise ValueError(f"special token {name!r} is not in the tokenizer's vocabulary")

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int:
        return self.hf.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int:
        return self.hf.token_to_id(self.pad_token)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.hf.token_to_id(self.bos_token)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; no BOS/EOS is added (the data pipeline places EOS itself)."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Like `encode` for many texts, in parallel inside the Rust library."""
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`. Bytes cut in the middle of a character decode to U+FFFD, never raise."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, directory: str | os.PathLike) -> Path:
        """Write tokenizer.json and tokenizer_config.json (readable by AutoTokenizer)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.hf.save(str(directory / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "bos_token": self.bos_token,
            "unk_token": self.unk_token,
            # Our decode is exact; transformers would otherwise tidy spaces before punctuation.
            "clean_up_tokenization_spaces": False,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return directory

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> Tokenizer:
        return cls.from_file(Path(directory) / "tokenizer.json")

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        """Load any HF tokenizer.json; special-token names come from a tokenizer_config.json
        beside it when there is one, otherwise from well-known names in the vocabulary."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}")
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises a bare Exception for bad JSON
            raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from e
        names = _config_special_tokens(path.parent / "tokenizer_config.json")
        vocab = hf.get_vocab(with_added_tokens=True)

        def pick(key: str, candidates: tuple[str, ...]) -> str | None:
            return names.get(key) or next((c for c in candidates if c in vocab), None)

        eos = pick("eos_token", EOS_NAMES)
        if eos is None:
            raise ValueError(
                f"{path}: no end-of-text token found; name one as eos_token in "
                f"tokenizer_config.json (tried {', '.join(EOS_NAMES)})"
            )
        try:
            return cls(
                hf,
                eos_token=eos,
                pad_token=pick("pad_token", PAD_NAMES) or eos,
                bos_token=pick("bos_token", BOS_NAMES),
                unk_token=pick("unk_token", UNK_NAMES),
            )
        except ValueError as e:  # a tokenizer_config.json naming a token the vocabulary lacks
            raise ValueError(f"{path}: {e}") from e


def _config_special_tokens(config_path: Path) -> dict[str, str]:
    """Special-token names in a tokenizer_config.json, which stores each as a str or an
    AddedToken dict ({"content": ...})."""
    if not config_path.is_file():
        return {}
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from e
    names = {}
    for key in ("eos_token", "pad_token", "bos_token", "unk_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            names[key] = value
    return names


def train_bpe(
    texts: Iterable[str] | Sequence[os.PathLike],
    vocab_size: int,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style), deterministic for the same input.

    `texts` is an iterable of strings, or a list of `Path`s to train from files (a plain
    `str` is always text). The first special token is end-of-text, the second (if any) padding.
    Every byte is in the initial alphabet, so any string encodes without an unknown token.
    """
    eos, pad = _roles(special_tokens)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(special_tokens):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: the {len(alphabet)} byte tokens and "
            f"{len(special_tokens)} special tokens alone need {len(alphabet) + len(special_tokens)}"
        )
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    if isinstance(texts, str):
        texts = [texts]
    if isinstance(texts, Sequence) and texts and all(isinstance(t, os.PathLike) for t in texts):
        hf.train([os.fspath(t) for t in texts], trainer)
    else:
        hf.train_from_iterator(texts, trainer)
    return Tokenizer(hf, eos_token=eos, pad_token=pad)


def train_char(text: str, special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS) -> Tokenizer:
    """A character-level tokenizer (nanoGPT's TinyShakespeare recipe): the special tokens,
    then an unknown token, then every distinct character of `text` in sorted order.
    Characters not seen in `text` encode to the unknown token."""
    eos, pad = _roles(special_tokens)
    tokens = [*special_tokens, UNK_TOKEN, *sorted(set(text))]
    hf = HFTokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=UNK_TOKEN))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one per char
    hf.decoder = decoders.Fuse()  # join characters back without spaces
    hf.add_special_tokens([*special_tokens, UNK_TOKEN])
    return Tokenizer(hf, eos_token=eos, pad_token=pad, unk_token=UNK_TOKEN)


def _roles(special_tokens: Sequence[str]) -> tuple[str, str]:
    """End-of-text is the first special token; padding the second, else end-of-text too."""
    if not special_tokens:
        raise ValueError("special_tokens must name at least the end-of-text token")
    return special_tokens[0], special_tokens[1] if len(special_tokens) > 1 else special_tokens[0]
