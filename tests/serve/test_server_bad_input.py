"""Every kind of bad input gets its status code and a message naming the problem, and the server
answers the next good call. Raw bytes go through a generic channel (no client-side checks)."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from baton.serve import proto
from baton.serve.client import BatonClient, generate_request
from baton.serve.kserve_tensors import encode_bytes
from baton.serve.runtime import Limits

from .server_fixtures import ServerThread

tc = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is a dev dependency")
BAD, NOT_FOUND, FULL = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED
GENERATE = f"/{proto.BATON_SERVICE}/Generate"
MODEL_INFER = f"/{proto.KSERVE_SERVICE}/ModelInfer"


@pytest.fixture(scope="module")
def server(llama_dir):
    s = ServerThread(llama_dir, limits=Limits(max_prompt_tokens=40, max_output_tokens=100, max_message_bytes=2**20))
    yield s
    s.stop()


def call_raw(target: str, method: str, data: bytes, streaming: bool) -> None:
    with grpc.insecure_channel(target) as ch:
        if streaming:
            list(ch.unary_stream(method)(data, timeout=30))
        else:
            ch.unary_unary(method)(data, timeout=30)


def gen(**kw) -> bytes:
    prompt = kw.pop("prompt", "The quick brown fox")
    return generate_request(prompt, **kw).SerializeToString()


def kserve_bytes(
    text: bytes | None = b"The fox",
    sampling: bytes | None = b"{}",
    stream: bool | None = None,
    model: str = "tiny",
    version: str = "",
    text_dtype: str = "BYTES",
    raw: bytes | None = None,
) -> bytes:
    req = proto.kserve("ModelInferRequest")(model_name=model, model_version=version, id="r")
    for name, dtype, value in (
        ("text_input", text_dtype, text),
        ("sampling_parameters", "BYTES", sampling),
        ("stream", "BOOL", stream),
    ):
        if value is not None:
            req.inputs.add(name=name, datatype=dtype, shape=[1])
            req.raw_input_contents.append(bytes([value]) if dtype == "BOOL" else encode_bytes([value]))
    if raw is not None:
        req.raw_input_contents[0] = raw
    return req.SerializeToString()


BATON_CASES = {  # name: (request bytes, status, words the message must contain)
    "malformed protobuf": (b"\xff\xff\xff\xff", BAD, "malformed GenerateRequest"),
    "non-UTF-8 text": (b"\x12\x02\xff\xfe", BAD, "malformed GenerateRequest"),
    "no prompt": (proto.baton("GenerateRequest")().SerializeToString(), BAD, "prompt"),
    "empty text": (gen(prompt=""), BAD, "prompt is empty"),
    "empty token ids": (gen(prompt=[]), BAD, "prompt is empty"),
    "token id outside vocab": (gen(prompt=[1, 99999]), BAD, "prompt token ids"),
    "unknown model": (gen(model="gpt-9"), NOT_FOUND, "unknown model 'gpt-9'"),
    "negative temperature": (gen(temperature=-1.0), BAD, "temperature"),
    "top_p zero": (gen(top_p=0.0), BAD, "top_p"),
    "n zero": (gen(n=0), BAD, "n must be"),
    "too many logprobs": (gen(logprobs=50), BAD, "logprobs"),
    "stop token outside vocab": (gen(stop_token_ids=[4000]), BAD, "stop_token_ids"),
    "max_tokens over the limit": (gen(max_tokens=101), BAD, "max_tokens"),
    "prompt over the limit": (gen(prompt=list(range(50))), BAD, "--max-prompt-tokens"),
    "message over the size limit": (gen(prompt="x" * (2**20 + 10)), FULL, ""),
}

KSERVE_CASES = {
    "unknown model": (kserve_bytes(model="nope"), NOT_FOUND, "unknown model 'nope'"),
    "unknown version": (kserve_bytes(version="7"), NOT_FOUND, "version '7'"),
    "malformed protobuf": (b"\x0a\xff", BAD, "malformed ModelInferRequest"),
    "invalid sampling JSON": (kserve_bytes(sampling=b"{temperature: 0"), BAD, "sampling_parameters is not valid JSON"),
    "unknown sampling field": (kserve_bytes(sampling=b'{"temprature": 0}'), BAD, "'temprature'"),
    "bad sampling value": (kserve_bytes(sampling=b'{"temperature": -2}'), BAD, "temperature must be >= 0"),
    "bad sampling type": (kserve_bytes(sampling=b'{"max_tokens": "many"}'), BAD, "sampling_parameters.max_tokens"),
    "non-UTF-8 sampling": (kserve_bytes(sampling=b"\xff"), BAD, "'sampling_parameters' is not valid UTF-8"),
    "non-UTF-8 text": (kserve_bytes(text=b"\xc3\x28"), BAD, "'text_input' is not valid UTF-8"),
    "empty text": (kserve_bytes(text=b""), BAD, "prompt is empty"),
    "missing text": (kserve_bytes(text=None), BAD, "'text_input' is required"),
    "wrong datatype": (kserve_bytes(text_dtype="INT32"), BAD, "must be BYTES"),
    "truncated raw bytes": (kserve_bytes(raw=b"\x09\x00\x00\x00abc"), BAD, "truncated"),
    "stream on unary infer": (kserve_bytes(stream=True), BAD, "ModelStreamInfer"),
    "prompt over the context": (kserve_bytes(text=b"The fox " * 200), BAD, "the model's context is 256"),
}


def check_still_serving(server: ServerThread) -> None:
    with BatonClient(server.target, timeout=30) as c:
        assert c.complete("The lazy dog", max_tokens=3, temperature=0).finished


@pytest.mark.parametrize("case", list(BATON_CASES))
def test_baton_bad_input(server, case):
    data, code, words = BATON_CASES[case]
    with pytest.raises(grpc.RpcError) as e:
        call_raw(server.target, GENERATE, data, streaming=True)
    assert e.value.code() == code, e.value.details()
    assert words in e.value.details()
    check_still_serving(server)


@pytest.mark.parametrize("case", list(KSERVE_CASES))
def test_kserve_bad_input(server, case):
    data, code, words = KSERVE_CASES[case]
    with pytest.raises(grpc.RpcError) as e:
        call_raw(server.target, MODEL_INFER, data, streaming=False)
    assert e.value.code() == code, e.value.details()
    assert words in e.value.details()
    check_still_serving(server)


def test_detokenize_outside_vocab(server):
    with BatonClient(server.target, timeout=30) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.detokenize([5, 100000])
        assert e.value.code() == BAD and "100000" in e.value.details()
    check_still_serving(server)


def test_stream_errors_stay_on_their_request(server):
    """On ModelStreamInfer a bad request gets error_message; the same stream then serves a good one."""
    import queue

    results: queue.Queue = queue.Queue()
    client = tc.InferenceServerClient(server.target)
    client.start_stream(callback=lambda result, error: results.put((result, error)))

    def inputs(sampling: dict):
        ins = [
            tc.InferInput("text_input", [1], "BYTES"),
            tc.InferInput("sampling_parameters", [1], "BYTES"),
            tc.InferInput("stream", [1], "BOOL"),
        ]
        ins[0].set_data_from_numpy(np.array([b"The quick"], dtype=object))
        ins[1].set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=object))
        ins[2].set_data_from_numpy(np.array([True]))
        return ins

    try:
        client.async_stream_infer("tiny", inputs({"top_p": 7}), request_id="bad")
        result, error = results.get(timeout=30)
        assert result is None and "top_p" in error.message() and "'bad'" in error.message()
        client.async_stream_infer(
            "tiny", inputs({"temperature": 0, "max_tokens": 4}), request_id="good", enable_empty_final_response=True
        )
        pieces, ids = [], set()
        while True:
            result, error = results.get(timeout=30)
            assert error is None
            ids.add(result.get_response().id)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
            pieces += list(result.as_numpy("text_output"))
        assert pieces and ids == {"good"}
    finally:
        client.stop_stream()
        client.close()
