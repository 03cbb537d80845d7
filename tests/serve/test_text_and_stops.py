"""Incremental detokenization, stop strings and stop tokens, streamed deltas."""

from __future__ import annotations

from baton.common.tokenizer import train_bpe
from baton.serve.core.detokenizer import IncrementalDetokenizer
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.sampling_params import SamplingParams

from .conftest import TEXT


def test_incremental_detokenizer_never_splits_characters():
    tok = train_bpe([TEXT], vocab_size=300)
    text = "naïve 🦊 fox 日本語 😀😀 x\n\ty"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) + detok.flush() == text
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0, "multi-byte characters must be held back until complete"


def test_flush_emits_incomplete_tail_as_replacement():
    """A character cut off by the end of the sequence is held back by add() and only flush() emits it:
    the text after flush is the tokenizer's own decode of all the ids, U+FFFD included."""
    tok = train_bpe([TEXT], vocab_size=300)
    cut = tok.encode("ok 🦊")[:-1]  # the fox's last byte never arrives
    whole = tok.decode(cut)
    assert whole.startswith("ok") and whole.endswith("\ufffd"), "the fox must span several tokens"
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.add(i) for i in cut)
    assert "\ufffd" not in streamed and streamed == detok.text
    assert len(streamed) < len(whole), "the incomplete tail must be held back until flush"
    tail = detok.flush()
    assert tail.endswith("\ufffd") and streamed + tail == detok.text == whole
    assert detok.flush() == "" and detok.text == whole, "a second flush emits nothing new"


def _run(engine, rid, prompt, params):
    engine.add_request(rid, prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_stop_strings_truncate_and_are_never_streamed(llama_dir):
    engine = LLMEngine.from_checkpoint(llama_dir, EngineConfig(num_kv_blocks=64, block_size=8))
    free_run = _run(engine, "free", "The quick", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[-1]
    full = free_run.outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3 and stop in full
    outs = _run(engine, "stop", "The quick", SamplingParams(temperature=0, max_tokens=40, stop=[stop], ignore_eos=True))
    final = outs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == full[: full.find(stop)]
    assert "".join(o.outputs[0].delta_text for o in outs) == final.text
    assert all(stop not in o.outputs[0].text for o in outs)
    incl = _run(
        engine,
        "incl",
        "The quick",
        SamplingParams(temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=True, ignore_eos=True),
    )[-1]
    assert incl.outputs[0].text == full[: full.find(stop) + len(stop)]


def test_stop_token_ids_and_eos(llama_dir):
    engine = LLMEngine.from_checkpoint(llama_dir, EngineConfig(num_kv_blocks=64, block_size=8))
    free_run = _run(engine, "free", "The quick", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[-1]
    ids = free_run.outputs[0].token_ids
    target = ids[5]
    out = _run(
        engine,
        "tok",
        "The quick",
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[target], ignore_eos=True),
    )[-1].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert out.token_ids == ids[: ids.index(target) + 1]
    engine.eos_ids = {target}  # as if the model's EOS were that token
    out = _run(engine, "eos", "The quick", SamplingParams(temperature=0, max_tokens=20))[-1].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None and out.token_ids[-1] == target
