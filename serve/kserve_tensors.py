"""KServe v2 tensors for an LLM model, with the tensor names Triton's LLM backends use.

Inputs: text_input BYTES, stream BOOL, sampling_parameters BYTES (JSON), exclude_input_in_output
BOOL; output: text_output BYTES. One request per call (each input holds one element), as with
Triton's vLLM backend. Raw contents follow the spec: a BYTES element is a 4-byte little-endian
length then the bytes; a BOOL element is one byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from google.protobuf.message import Message

from baton.serve.request_params import from_json
from baton.serve.rpc import invalid
from baton.serve.sampling_params import SamplingParams

INPUTS = {"text_input": "BYTES", "stream": "BOOL", "sampling_parameters": "BYTES", "exclude_input_in_output": "BOOL"}
OUTPUT = "text_output"


@dataclass
class LLMRequest:
    prompt: str
    params: SamplingParams
    stream: bool
    exclude_input: bool  # False: text_output starts with the prompt
    empty_final: bool  # the client asked for an empty response marking the end (decoupled)


def decode_bytes(raw: bytes, name: str) -> list[bytes]:
    items, i = [], 0
    while i < len(raw):
        n = int.from_bytes(raw[i : i + 4], "little") if i + 4 <= len(raw) else None
        if n is None or i + 4 + n > len(raw):
            raise invalid(
                f"input {name!r}: raw BYTES contents are truncated (each element is a 4-byte "
                "little-endian length, then that many bytes)"
            )
        items.append(raw[i + 4 : i + 4 + n])
        i += 4 + n
    return items


def encode_bytes(items: list[bytes]) -> bytes:
    return b"".join(len(x).to_bytes(4, "little") + x for x in items)


def _read_inputs(req: Message) -> dict[str, bytes | bool]:
    raw = req.raw_input_contents
    if raw and len(raw) != len(req.inputs):
        raise invalid(f"raw_input_contents has {len(raw)} entries for {len(req.inputs)} inputs")
    values: dict[str, bytes | bool] = {}
    for i, t in enumerate(req.inputs):
        want = INPUTS.get(t.name)
        if want is None:
            raise invalid(f"unknown input {t.name!r}; this model takes {', '.join(INPUTS)}")
        if t.datatype != want:
            raise invalid(f"input {t.name!r} must be {want}, got {t.datatype!r}")
        if raw:
            items = decode_bytes(raw[i], t.name) if want == "BYTES" else [b != 0 for b in raw[i]]
        else:
            items = list(t.contents.bytes_contents if want == "BYTES" else t.contents.bool_contents)
        count = math.prod(t.shape)
        if count != len(items):
            raise invalid(f"input {t.name!r}: shape {list(t.shape)} holds {count} elements but {len(items)} were sent")
        if len(items) != 1:
            raise invalid(f"input {t.name!r} must hold exactly one element (one request per call), got {len(items)}")
        values[t.name] = items[0]
    return values


def _utf8(value: bytes, name: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"input {name!r} is not valid UTF-8: {e}") from None


def parse_llm_request(req: Message) -> LLMRequest:
    values = _read_inputs(req)
    if "text_input" not in values:
        raise invalid("input 'text_input' is required")
    for out in req.outputs:
        if out.name != OUTPUT:
            raise invalid(f"unknown output {out.name!r}; this model returns {OUTPUT!r}")
    stream = bool(values.get("stream", False))
    params = from_json(_utf8(values.get("sampling_parameters", b""), "sampling_parameters"))
    empty_final = req.parameters.get("triton_enable_empty_final_response")
    return LLMRequest(
        prompt=_utf8(values["text_input"], "text_input"),
        params=params,
        stream=stream,
        # Triton's vLLM backend default: the prompt is repeated unless streaming.
        exclude_input=bool(values.get("exclude_input_in_output", stream)),
        empty_final=bool(empty_final is not None and empty_final.bool_param),
    )


def fill_response(resp: Message, texts: list[str] | None, final: bool | None) -> Message:
    """Add text_output (one element per sample) and, for streams, the final-response flag."""
    if texts is not None:
        resp.outputs.add(name=OUTPUT, datatype="BYTES", shape=[len(texts)])
        resp.raw_output_contents.append(encode_bytes([t.encode("utf-8") for t in texts]))
    if final is not None:
        resp.parameters["triton_final_response"].bool_param = final
    return resp
