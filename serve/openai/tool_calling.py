"""Tool calling and reasoning output for one chat turn, shared by /v1/chat/completions and /v1/responses.

Two layers:
- `AgentConfig` (server flags, vLLM's names: --tool-call-parser, --enable-auto-tool-choice,
  --reasoning-parser, --chat-template), validated before the model loads; `Agents` is what a loaded
  server shares (the chat template, the parser classes, the end-of-thinking token ids).
- `ChatTurn`, one request: built from plain values (messages, OpenAI chat-style `tools`,
  tool_choice, parallel_tool_calls, chat_template_kwargs, thinking budget), so both endpoints map
  their own request shapes onto it. Its life: `ChatTurn(...)` validates (BadParam naming the
  param) -> `render()` the prompt ids (blocking: jinja; run it in a thread) -> `apply(params)` sets
  the grammar (`structured`), `thinking` and special-token handling -> `parse(output)` for a unary
  answer, or one `stream()` per choice whose `step(output)` turns each engine output into a
  `TurnDelta` (reasoning / content / tool-call pieces).

The output pipeline is reasoning first, then tools on what is left (vLLM's order): thinking never
reaches `content`, and a call written inside the thinking is not a call.

tool_choice (OpenAI's semantics, enforcement Baton's):
- "none": tools are rendered into the prompt (the template decides how), nothing is parsed.
- "auto": parsed with the server's parser; needs --enable-auto-tool-choice (as vLLM). Where the
  request has no response_format, the parser's structural tag (required=False) keeps any call the
  model starts well-formed; a call that still does not parse comes back as content (counted).
- "required" / a named function: the structural tag with required=True over all tools / the one,
  so the output is calls only, each naming an allowed function with arguments valid against its
  schema. That grammar replaces response_format (as vLLM's tool grammar does): there is no content
  for it to shape.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from baton.common.tokenizer import Tokenizer
from baton.serve.core.structured import StructuredOutputs
from baton.serve.metrics import ServerMetrics
from baton.serve.openai.chat import ChatTemplate, chat_template, read_template_file
from baton.serve.openai.harmony_vocab import harmony_encoding
from baton.serve.openai.protocol import BadParam
from baton.serve.openai.reasoning import REASONING_PARSERS, reasoning_parser_class
from baton.serve.openai.reasoning.base import ReasoningParser
from baton.serve.openai.tool_parsers import TOOL_PARSERS, default_tool_parser, tool_parser_class
from baton.serve.openai.tool_parsers.base import ToolCall, ToolCallDelta, ToolParser
from baton.serve.outputs import CompletionOutput
from baton.serve.sampling_params import SamplingParams, Thinking
from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")
NO_PARAMETERS = {"type": "object", "properties": {}}  # a function declared without parameters
MAX_WHITESPACE = 1  # consecutive whitespace characters a call's JSON may hold (", " and ": " need one)


@dataclass
class AgentConfig:
    """The server's agent flags. tool_call_parser None: the checkpoint family's default parser
    (config.json's model_type, tool_parsers.FAMILY_PARSERS), used for required/named tool_choice
    always and for "auto" only with enable_auto_tool_choice."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    chat_template: str | None = None  # a jinja file replacing the checkpoint's chat template

    def validate(self) -> None:
        """Refuse unknown names and a bad template file at start, before the model loads."""
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"unknown --tool-call-parser {self.tool_call_parser!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"unknown --reasoning-parser {self.reasoning_parser!r}; "
                f"choose one of {', '.join(sorted(REASONING_PARSERS))}"
            )
        if self.chat_template is not None:
            read_template_file(self.chat_template)  # unreadable or not jinja: refused now, not per request


def model_type(model_dir: str | Path) -> str | None:
    """The checkpoint's family (config.json's model_type), which picks the default tool parser."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


class Agents:
    """What every chat turn of one server shares, built once when the model loads."""

    def __init__(
        self,
        config: AgentConfig,
        model_dir: str | Path,
        tokenizer: Tokenizer | None,
        eos_ids: set[int],
        metrics: ServerMetrics | None = None,
    ):
        self.config, self.tokenizer, self.eos_ids, self.metrics = config, tokenizer, set(eos_ids), metrics
        self.template: ChatTemplate = chat_template(model_dir, config.chat_template)
        self.parser_name = config.tool_call_parser or default_tool_parser(model_type(model_dir) or "")
        self.tool_parser: type[ToolParser] | None = tool_parser_class(self.parser_name) if self.parser_name else None
        self.reasoning: type[ReasoningParser] | None = (
            reasoning_parser_class(config.reasoning_parser) if config.reasoning_parser else None
        )
        if "openai" in (self.parser_name, config.reasoning_parser):  # harmony's vocabulary now, not in a request
            harmony_encoding()
        self.think_end_ids: list[int] = (
            tokenizer.encode(self.reasoning.end_text) if self.reasoning is not None and tokenizer is not None else []
        )
        # the tokenizer's special tokens: text that detokenization drops unless asked to keep it
        self.specials: set[str] = set()
        if tokenizer is not None:
            self.specials = {t.content for t in tokenizer.hf.get_added_tokens_decoder().values() if t.special}

    def turn(self, messages: list, **kw) -> ChatTurn:
        return ChatTurn(self, messages, **kw)


def validate_tools(tools: list | None) -> list[dict]:
    """OpenAI chat tools, checked (BadParam naming e.g. tools[1].function.parameters) and normalised:
    {"type": "function", "function": {"name", "description"?, "parameters"}}."""
    if tools is None:
        return []
    if not isinstance(tools, list) or not tools:
        raise BadParam("tools must be a non-empty list (omit it for no tools)", "tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise BadParam(f"{where}.type must be 'function' (the only tool type chat supports)", f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise BadParam(f"{where}.function must be an object with a name", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise BadParam(
                f"{where}.function.name must be 1-64 characters of a-z, A-Z, 0-9, _ or -; got {name!r}",
                f"{where}.function.name",
            )
        if name in seen:
            raise BadParam(f"{where}.function.name {name!r} is given twice", f"{where}.function.name")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise BadParam(f"{where}.function.description must be a string", f"{where}.function.description")
        params = fn.get("parameters")
        if params is None:
            params = NO_PARAMETERS
        where_p = f"{where}.function.parameters"
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise BadParam(f"{where_p} must be a JSON schema of type 'object' (the arguments object)", where_p)
        try:
            validator_for(params).check_schema(params)
        except SchemaError as e:
            raise BadParam(f"{where_p} is not a valid JSON schema: {e.message}", where_p) from None
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def validate_tool_choice(choice, tools: list[dict]) -> str | dict:
    """ "none" | "auto" | "required" | the named tool's function dict. Omitted: "auto" with tools,
    else "none" (OpenAI's defaults)."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise BadParam(f"tool_choice must be one of {', '.join(CHOICES)} or a named function", "tool_choice")
        if choice != "none" and not tools:
            raise BadParam(f'tool_choice "{choice}" needs tools', "tool_choice")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise BadParam('tool_choice must be {"type": "function", "function": {"name": ...}} to name one', "tool_choice")
    for t in tools:
        if t["function"]["name"] == name:
            return t["function"]
    raise BadParam(f"tool_choice names {name!r}, which is not among the request's tools", "tool_choice")


def _bounded_whitespace(node):
    """The tag with each JSON-schema format that sets no max_whitespace_cnt given MAX_WHITESPACE:
    xgrammar's JSON otherwise admits any whitespace between tokens, and a weak model pads a call
    with it until max_tokens (the engine's response_format grammar forbids padding likewise)."""
    if isinstance(node, list):
        return [_bounded_whitespace(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _bounded_whitespace(v) for k, v in node.items()}
    if out.get("type") == "json_schema" and "json_schema" in out:
        out.setdefault("max_whitespace_cnt", MAX_WHITESPACE)
    return out


def _markers(tag: dict) -> list[str]:
    """The strings a structural tag starts calls with: its triggers, else its tags' begin strings."""
    found: dict[str, list[str]] = {"triggers": [], "begin": []}

    def walk(node) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "triggers" and isinstance(v, list):
                    found["triggers"] += [s for s in v if isinstance(s, str)]
                elif k == "begin" and isinstance(v, str):
                    found["begin"].append(v)
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(tag)
    return [s for s in found["triggers"] or found["begin"] if s]


@dataclass
class TurnDelta:
    """What one engine output adds to a choice, split: reasoning text, content text, call pieces."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def to_chat(self) -> dict:
        """The chat chunk's `delta` (reasoning under both reasoning_content and vLLM's `reasoning`)."""
        out: dict = {}
        if self.reasoning:
            out["reasoning_content"] = out["reasoning"] = self.reasoning
        if self.content:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [d.to_openai() for d in self.tool_calls]
        return out


@dataclass
class TurnResult:
    """One choice's whole answer: reasoning (None: none was produced or no reasoning parser),
    content, calls, and the finish_reason to report ("tool_calls" when calls ended it)."""

    reasoning: str | None
    content: str
    tool_calls: list[ToolCall]
    finish_reason: str | None

    def to_chat(self, with_reasoning: bool) -> dict:
        """The chat `message`: content None when only calls came back, as OpenAI sends it."""
        msg: dict = {"role": "assistant", "content": self.content if self.content or not self.tool_calls else None}
        if with_reasoning:
            msg["reasoning_content"] = msg["reasoning"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


class ChatTurn:
    """One request's turn (see the module docstring for its life)."""

    def __init__(
        self,
        agents: Agents,
        messages: list,
        tools: list | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool = True,
        chat_template_kwargs: dict | None = None,
        thinking_budget: int | None = None,
    ):
        self.agents, self.messages = agents, messages
        self.tools = validate_tools(tools)
        self.tool_choice = validate_tool_choice(tool_choice, self.tools)
        if not isinstance(parallel_tool_calls, bool):
            raise BadParam("parallel_tool_calls must be true or false", "parallel_tool_calls")
        self.parallel = parallel_tool_calls
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise BadParam("chat_template_kwargs must be an object", "chat_template_kwargs")
        self.template_kwargs = chat_template_kwargs or {}
        if thinking_budget is not None:
            if isinstance(thinking_budget, bool) or not isinstance(thinking_budget, int) or thinking_budget < 0:
                raise BadParam("thinking_token_budget must be an integer >= 0", "thinking_token_budget")
            if agents.reasoning is None:
                raise BadParam(
                    "thinking_token_budget needs a server started with --reasoning-parser", "thinking_token_budget"
                )
            if agents.reasoning.name == "openai":  # harmony's analysis is a message of its own, never "open"
                raise BadParam(
                    "thinking_token_budget is not supported with the openai (harmony) reasoning parser: gpt-oss "
                    "opens its analysis channel itself, so there is no thinking to cut short at the prompt's end",
                    "thinking_token_budget",
                )
        self.thinking_budget = thinking_budget
        self.parsing = self.tool_choice != "none"  # tools parsed from the output
        if self.parsing and agents.tool_parser is None:
            raise BadParam(
                f"tool_choice {self._choice_text()} needs a tool-call parser: this checkpoint's family has no "
                "default, so start the server with --tool-call-parser NAME",
                "tool_choice",
            )
        if self.tool_choice == "auto" and not agents.config.enable_auto_tool_choice:
            raise BadParam(
                'tool_choice "auto" (the default when tools are given) needs a server started with '
                '--enable-auto-tool-choice; send tool_choice "none", "required" or a named function otherwise',
                "tool_choice",
            )
        self.prompt_text = ""
        self.in_thinking = False
        self.keep_special = False  # set by apply(): special tokens kept for the parser, EOS trimmed
        self.tool_grammar = False  # set by apply(): the output is constrained by the tools' structural tag
        self._markers: list[str] = []

    def _choice_text(self) -> str:
        c = self.tool_choice
        return f'"{c}"' if isinstance(c, str) else f"naming {c['name']!r}"

    # ------------------------------------------------------------------------------ prompt
    def render(self) -> list[int]:
        """The prompt's token ids (blocking: the template runs jinja). ValueError("messages...")
        for messages the template or the checks refuse (e.g. an unknown tool_call_id)."""
        tok = self.agents.tokenizer
        if tok is None:
            raise BadParam("this model has no tokenizer: chat needs one", "messages")
        self.prompt_text = self.agents.template.render(
            self.messages, tools=self.tools or None, template_kwargs=self.template_kwargs
        )
        if self.agents.reasoning is not None:
            self.in_thinking = self.agents.reasoning.thinking_at_start(self.prompt_text)
        return tok.encode(self.prompt_text)

    def apply(self, params: SamplingParams) -> None:
        """Set the turn's grammar, thinking and special-token handling on the request's params
        (after render, which decides whether generation starts inside thinking)."""
        tag = None
        if self.parsing:
            required = self.tool_choice != "auto"
            functions = [t["function"] for t in self.tools] if isinstance(self.tool_choice, str) else [self.tool_choice]
            parallel = self.parallel and not isinstance(self.tool_choice, dict)  # a named function: one call
            parser = self.agents.tool_parser(self.tools)
            tag = _bounded_whitespace(parser.structural_tag(functions, required=required, parallel=parallel))
            self._markers = _markers(tag) if not required else []
            if required or params.structured is None:  # auto + response_format: the format wins (vLLM)
                params.structured = StructuredOutputs(structural_tag=tag)
                self.tool_grammar = True
        if self.agents.reasoning is not None and self.agents.think_end_ids:
            params.thinking = Thinking(
                end_token_ids=list(self.agents.think_end_ids), budget=self.thinking_budget, in_thinking=self.in_thinking
            )
        # markers the tokenizer calls special (Llama 3's <|python_tag|>, Mistral's [TOOL_CALLS], harmony's
        # <|channel|>) would vanish in detokenization: keep them (as vLLM's parsers ask), and trim EOS
        texts = ([json.dumps(tag, ensure_ascii=False)] if tag is not None else []) + (
            [self.agents.reasoning.end_text] if self.agents.reasoning is not None else []
        )
        if params.skip_special_tokens and any(s in t for s in self.agents.specials for t in texts):
            params.skip_special_tokens, self.keep_special = False, True

    # ------------------------------------------------------------------------------ output
    def _text(self, c: CompletionOutput, text: str, ids: list[int]) -> str:
        """`text` without the EOS token's text when we kept special tokens (the caller did not ask)."""
        if self.keep_special and c.finish_reason == "stop" and ids and ids[-1] in self.agents.eos_ids:
            eos = self.agents.tokenizer.decode([ids[-1]])
            if text.endswith(eos):
                return text[: len(text) - len(eos)]
        return text

    def _reasoning_parser(self) -> ReasoningParser | None:
        cls = self.agents.reasoning
        return None if cls is None else cls(starts_in_reasoning=self.in_thinking)

    def parse(self, c: CompletionOutput) -> TurnResult:
        """A finished choice as reasoning, content and calls."""
        text = self._text(c, c.text, c.token_ids)
        rp = self._reasoning_parser()
        reasoning, content = rp.split(text) if rp is not None else (None, text)
        calls: list[ToolCall] = []
        if self.parsing:
            parsed = self.agents.tool_parser(self.tools).parse(content)
            content, calls = parsed.content, parsed.tool_calls
            if not self.parallel:
                calls = calls[:1]
            self._count(len(calls), content)
        return TurnResult(reasoning, content, calls, _finish(c.finish_reason, bool(calls)))

    def _count(self, calls: int, content: str) -> None:
        """Metrics: calls returned, and (under auto) a started call that did not parse."""
        m = self.agents.metrics
        if m is None:
            return
        if calls:
            m.tool_calls.labels(self.agents.parser_name).inc(calls)
        if any(s in content for s in self._markers):
            m.tool_call_parse_failures.labels(self.agents.parser_name).inc()

    def stream(self) -> ChoiceStream:
        """A streaming state for one choice (n > 1: one each)."""
        return ChoiceStream(self)

    @property
    def with_reasoning(self) -> bool:
        """Whether answers carry the reasoning fields (a reasoning parser is on)."""
        return self.agents.reasoning is not None


class ChoiceStream:
    """One choice's streamed pipeline: engine text deltas -> reasoning / content / call pieces."""

    def __init__(self, turn: ChatTurn):
        self.turn = turn
        self.reasoning = turn._reasoning_parser()
        self.tools = turn.agents.tool_parser(turn.tools) if turn.parsing else None
        self.calls: set[int] = set()
        self.content = ""  # what went out as content, for the parse-failure count
        self.done = False

    def step(self, c: CompletionOutput) -> tuple[TurnDelta, str | None]:
        """This output's new pieces, and the finish_reason once the choice has finished (else None)."""
        text = self.turn._text(c, c.delta_text, c.token_ids)
        out = TurnDelta()
        if self.reasoning is not None:
            self._add(out, self.reasoning.feed(text))
        else:
            self._content(out, text)
        if c.finish_reason is None or self.done:
            return out, None
        self.done = True
        if self.reasoning is not None:
            self._add(out, self.reasoning.finish())
        if self.tools is not None:
            tail = self.tools.finish()
            self._take(out, tail.content, tail.tool_calls)
            self.turn._count(len(self.calls), self.content)
        return out, _finish(c.finish_reason, bool(self.calls))

    def _add(self, out: TurnDelta, d) -> None:
        out.reasoning += d.reasoning
        self._content(out, d.content)

    def _content(self, out: TurnDelta, text: str) -> None:
        if not text:
            return
        if self.tools is None:
            out.content += text
            return
        d = self.tools.feed(text)
        self._take(out, d.content, d.tool_calls)

    def _take(self, out: TurnDelta, content: str, calls: list[ToolCallDelta]) -> None:
        out.content += content
        self.content += content
        for d in calls:
            if d.index > 0 and not self.turn.parallel:
                continue  # parallel_tool_calls=false: the first call only, as parse() keeps
            self.calls.add(d.index)
            out.tool_calls.append(d)
