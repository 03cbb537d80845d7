"""Structured outputs enforced during sampling, with xgrammar (a pushdown automaton over the vocabulary).

A request's StructuredOutputs (serve/core/structured.py) is compiled once per distinct spec against the
checkpoint's tokenizer (GrammarCache; an invalid schema/regex/grammar/structural tag is a ValueError at
admission, before anything is scheduled; hits and misses are counted per kind). Each sequence owns a
SequenceGrammar (an xgrammar GrammarMatcher, after the thinking phase of SamplingParams.thinking when
there is one; n > 1 samples fork it). Every step the sampler masks a constrained row's logits with the
matcher's token bitmask (or, past a thinking budget, with the one end-marker token forced) before
penalties, temperature and truncation (so a constrained row can only draw an allowed token, and
reports the masked logprobs, as vLLM does); the engine accepts the sampled token into the
SequenceGrammar and finishes the sequence ("stop") when the matcher terminates (the grammar is
complete and an EOS token was taken). Unconstrained batches pay one Python scan.

Preemption never drops tokens (recompute re-reads them, swap keeps the KV), so a matcher's state
stays that of the sequence's output. Speculative decoding: proposals that leave the grammar (or the
forced end marker) are cut before the forward (prune_proposals, by accept + rollback), and
verification draws every token from the masked target distribution at its position (the
SequenceGrammar advances with each token verification keeps), so it only ever keeps tokens the
grammar allows, and a proposal path may cross the end of thinking.
"""

from __future__ import annotations

import collections
import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from baton.common.hf import transformers_class
from baton.common.tokenizer import Tokenizer
from baton.serve.core.sequence import Sequence
from baton.serve.core.structured import SequenceGrammar, StructuredOutputs
from baton.serve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import xgrammar as xgr

log = logging.getLogger(__name__)
_CACHE_ENTRIES = 256  # compiled grammars kept (LRU); each is a few KB to a few MB
# the string character classes xgrammar writes (plain strings; length-limited ones)
_STRING_CHARS = re.compile(re.escape(r"[^\0-\x1f\"\\\r\n]") + "|" + re.escape(r"[^\"\\\r\n]"))
_STRING_CHARS_FIXED = r"[^\0-\x1f\"\\\r\n\uD800-\uDFFF]"
_XGR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")  # "[18:58:14] /project/cpp/x.cc:94: "
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false: ")  # the C++ condition, before the message
# structural-tag formats that name tokens: only a compiler (with the vocabulary) can resolve them
_TOKEN_FORMATS = {"token", "exclude_token", "any_tokens", "token_triggered_tags", "token_dispatch"}


def json_schema_ebnf(schema: str | dict, strict_mode: bool = True) -> str:
    """xgrammar's grammar for a JSON schema, compact (", " and ": ": any whitespace lets a model pad
    forever), with one fix: xgrammar 0.2.9's string characters admit UTF-16 surrogates (invalid
    UTF-8, decoded as U+FFFD) and, under maxLength/minLength, raw control characters, which JSON
    forbids; both are excluded from every string character class."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict_mode))
    return _STRING_CHARS.sub(lambda _: _STRING_CHARS_FIXED, text)


def _names_tokens(node) -> bool:
    if isinstance(node, dict):
        return node.get("type") in _TOKEN_FORMATS or any(_names_tokens(v) for v in node.values())
    return isinstance(node, list) and any(_names_tokens(v) for v in node)


def _from_legacy(tag: dict) -> dict:
    """vLLM's legacy structural tag as xgrammar's current form: any text, and after a trigger, the
    tag it begins (begin, JSON of its schema, end)."""
    import pydantic
    import xgrammar as xgr

    structures, triggers = tag["structures"], tag.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list):
        raise ValueError('the legacy form needs "structures" and "triggers" lists')
    items = []
    for i, item in enumerate(structures):
        try:
            items.append(xgr.StructuralTagItem.model_validate(item))
        except pydantic.ValidationError as e:
            err = e.errors()[0]
            raise ValueError(f"structures[{i}]: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    return xgr.StructuralTag.from_legacy_structural_tag(items, triggers).model_dump(mode="json", by_alias=True)


def structural_tag_ebnf(tag: str | dict, compiler: xgr.GrammarCompiler) -> str:
    """xgrammar's grammar for a structural tag, with json_schema_ebnf's string fix applied to the
    JSON its json_schema formats write (whitespace stays as the tag asks: its formats take
    max_whitespace_cnt). vLLM's legacy form ({"structures": [{"begin", "schema", "end"}],
    "triggers"}) is converted the way vLLM does. A tag naming tokens is resolved by the compiler."""
    import xgrammar as xgr

    tag = json.loads(tag) if isinstance(tag, str) else tag
    if "structures" in tag:
        tag = _from_legacy(tag)
    text = json.dumps(tag)
    grammar = compiler.compile_structural_tag(text).grammar if _names_tokens(tag) else None
    text = str(grammar if grammar is not None else xgr.Grammar.from_structural_tag(text))
    return _STRING_CHARS.sub(lambda _: _STRING_CHARS_FIXED, text)


@dataclass
class GrammarCacheStats:
    """Per spec kind ("json", "structural_tag", ...): requests admitted with a grammar already
    compiled (hits) and requests that compiled theirs (misses), and the seconds spent compiling."""

    hits: dict[str, int] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)
    compile_seconds: dict[str, float] = field(default_factory=dict)


class GrammarCache:
    """Compiles StructuredOutputs against one tokenizer, once per distinct spec (LRU). Thread-safe:
    servers validate (compile) in a worker thread while the engine steps in another."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_ids: set[int]):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._compiler: xgr.GrammarCompiler | None = None  # built on the first structured request
        self._compiled: collections.OrderedDict[tuple[str, str], xgr.CompiledGrammar] = collections.OrderedDict()
        # compiled (at validation) but no request admitted with it yet: the first such admission is the miss
        self._unused: set[tuple[str, str]] = set()
        self.hits: collections.Counter[str] = collections.Counter()
        self.misses: collections.Counter[str] = collections.Counter()
        self.compile_seconds: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._unavailable: str | None = None  # why prepare() could not build the compiler

    def prepare(self) -> None:
        """Build the compiler now (servers call this when the model loads, so no request imports
        xgrammar or builds its tokenizer data). A model that cannot constrain still serves: each
        structured request is told why."""
        with self._lock:
            if self.tokenizer is None or not self.eos_ids:
                return  # _get_compiler says so per request
            try:
                self._get_compiler()
            except Exception as e:  # noqa: BLE001 - e.g. a tokenizer xgrammar cannot read
                self._unavailable = f"structured outputs are unavailable for this model: {type(e).__name__}: {e}"
                log.warning("%s", self._unavailable)

    def _get_compiler(self) -> xgr.GrammarCompiler:
        if self._unavailable is not None:
            raise ValueError(self._unavailable)
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the checkpoint's tokenizer; this model has none")
            if not self.eos_ids:
                raise ValueError("structured outputs need an EOS token to end on; this model has none")
            import xgrammar as xgr  # offline: with the first structured request (~0.2 s), not with the engine

            tok = self.tokenizer  # transformers deep-copies tokenizer_object: the engine's stays its own
            fast = transformers_class("PreTrainedTokenizerFast")(tokenizer_object=tok.hf, eos_token=tok.eos_token)
            info = xgr.TokenizerInfo.from_huggingface(fast, vocab_size=self.vocab_size, stop_token_ids=self.eos_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        """The compiled grammar of a validated spec; ValueError naming it if xgrammar rejects it."""
        key = spec.key()
        with self._lock:
            return self._compile(spec, key)

    def _compile(self, spec: StructuredOutputs, key: tuple[str, str]) -> xgr.CompiledGrammar:
        """`key`: spec.key(), computed once per call (canonicalising a big tool set's JSON is not free)."""
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
            return compiled
        compiler = self._get_compiler()
        kind, start = spec.kind, time.perf_counter()
        try:
            if kind == "structural_tag":
                compiled = compiler.compile_grammar(structural_tag_ebnf(spec.structural_tag, compiler))
            elif kind == "json":
                compiled = compiler.compile_grammar(json_schema_ebnf(spec.json))
            elif kind == "json_object":  # any JSON object (strict_mode would allow only {})
                compiled = compiler.compile_grammar(json_schema_ebnf({"type": "object"}, strict_mode=False))
            elif kind == "regex":
                compiled = compiler.compile_regex(spec.regex)
            else:
                compiled = compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            what = {"json": "JSON schema", "regex": "regex", "grammar": "EBNF grammar"}.get(kind, "structural tag")
            detail = _XGR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else repr(e))
            detail = _CHECK_FAILED.sub("", detail)
            raise ValueError(f"structured outputs: the {what} is not supported or invalid: {detail}") from None
        self.compile_seconds[kind] += time.perf_counter() - start
        self._compiled[key] = compiled
        self._unused.add(key)
        if len(self._compiled) > _CACHE_ENTRIES:
            self._unused.discard(self._compiled.popitem(last=False)[0])
        return compiled

    def _matcher(self, spec: StructuredOutputs) -> xgr.GrammarMatcher:
        """A new sequence's matcher: one admitted request, counted as a cache hit or miss."""
        import xgrammar as xgr

        key = spec.key()
        with self._lock:
            compiled = self._compile(spec, key)
            fresh = key in self._unused
            self._unused.discard(key)
            (self.misses if fresh else self.hits)[spec.kind] += 1
        return xgr.GrammarMatcher(compiled)

    def matcher(self, spec: StructuredOutputs) -> SequenceGrammar:
        return SequenceGrammar(self._matcher(spec))

    def sequence_grammar(self, params: SamplingParams) -> SequenceGrammar | None:
        """A new sequence's constraint: its structured outputs after its thinking phase (None: neither)."""
        if params.structured is None and params.thinking is None:
            return None
        matcher = self._matcher(params.structured) if params.structured is not None else None
        t = params.thinking
        return SequenceGrammar(matcher, *((t.end_token_ids, t.budget, t.in_thinking) if t is not None else ()))

    def stats(self) -> GrammarCacheStats:
        with self._lock:
            return GrammarCacheStats(dict(self.hits), dict(self.misses), dict(self.compile_seconds))


def mask_logits(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place: each constrained row of logits [len(seqs), vocab] keeps only the tokens its
    sequence's grammar allows next (the rest become -inf): the one forced token past a thinking
    budget, else the matcher's mask once thinking is over. No constrained row: nothing to do."""
    forced = [
        (i, t) for i, s in enumerate(seqs) if s.grammar is not None and (t := s.grammar.forced_token()) is not None
    ]
    if forced:  # no xgrammar: a thinking budget needs no grammar
        rows = torch.tensor([i for i, _ in forced], device=logits.device)
        tokens = torch.tensor([t for _, t in forced], device=logits.device)
        kept = logits[rows, tokens]
        logits[rows] = -torch.inf
        logits[rows, tokens] = kept
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None and s.grammar.matching]
    if not rows:
        return
    import xgrammar as xgr

    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(seqs), vocab)
    for i in rows:
        seqs[i].grammar.matcher.fill_next_token_bitmask(bitmask, i)
    if logits.device.type != "cpu":  # xgrammar's kernel on CUDA; its torch version elsewhere
        pinned = bitmask.pin_memory() if logits.device.type == "cuda" else bitmask  # no sync on the copy
        bitmask = pinned.to(logits.device, non_blocking=True)
    backend = "auto" if logits.device.type in ("cpu", "cuda") else "torch_native"
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows, backend=backend)


def mask_row(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """One row [vocab] masked by seq's grammar (a new tensor; the row itself when unconstrained)."""
    if seq.grammar is None or not seq.grammar.restricts:
        return logits
    out = logits.float().clone().unsqueeze(0)
    mask_logits(out, [seq])
    return out[0]


def prune_proposals(seqs: list[Sequence]) -> None:
    """Cut each constrained sequence's speculative proposals (chain or tree) to those the grammar
    allows along their path: verification would reject the rest anyway (the target gives them no
    mass), so only the forward's work changes, never the output."""
    for seq in seqs:
        if seq.grammar is None or not seq.spec_token_ids:
            continue
        m, proposals, parents = seq.grammar, seq.spec_token_ids, seq.spec_parents
        if parents is None:  # a chain: the allowed prefix
            keep = 0
            while keep < len(proposals) and m.try_accept(proposals[keep]):
                keep += 1
            if keep:
                m.rollback(keep)
            seq.spec_token_ids = proposals[:keep]
            if seq.spec_draft_probs is not None:
                seq.spec_draft_probs = seq.spec_draft_probs[:keep] if keep else None
            continue
        ok, new_index, kept_parents = [], {}, []  # a tree (parents before children): nodes whose path is allowed
        for i, parent in enumerate(parents):
            path = [i]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            path.reverse()
            good = parent < 0 or ok[parent]
            if good:
                accepted = 0
                for node in path:
                    if not m.try_accept(proposals[node]):
                        good = False
                        break
                    accepted += 1
                if accepted:
                    m.rollback(accepted)
            ok.append(good)
            if good:
                new_index[i] = len(kept_parents)
                kept_parents.append(-1 if parent < 0 else new_index[parent])
        kept = [i for i, good in enumerate(ok) if good]
        seq.spec_token_ids = [proposals[i] for i in kept]
        seq.spec_parents = kept_parents if kept else None
        if seq.spec_draft_probs is not None:
            seq.spec_draft_probs = seq.spec_draft_probs[kept] if kept else None
