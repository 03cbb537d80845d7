"""Extreme sampling parameters through a real server: the numerics are served (a temperature or
top_p of 1e-300 gives the offline engine's greedy output), the bounds are refused with
INVALID_ARGUMENT naming the field or the flag, and after each call the engine still serves."""

from __future__ import annotations

import json

import grpc
import pytest

from baton.common.cli import build_parser
from baton.serve import proto
from baton.serve import server as server_module
from baton.serve.client import BatonClient, generate_request
from baton.serve.kserve_tensors import decode_bytes, encode_bytes
from baton.serve.runtime import Limits

from .server_fixtures import ServerThread, offline

BAD = grpc.StatusCode.INVALID_ARGUMENT
PROMPT, TOKENS = "The quick brown fox", 8
I64 = 2**63 - 1


@pytest.fixture(scope="module")
def server(llama_dir):
    s = ServerThread(
        llama_dir,
        limits=Limits(
            max_output_tokens=32, max_n=4, max_stop_strings=8, max_stop_string_chars=32, max_stop_token_ids=8
        ),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def greedy(llama_dir) -> str:
    return offline(llama_dir, [PROMPT], TOKENS)[0][1]


def kserve(target: str, sampling: bytes | str) -> str:
    """One ModelInfer call; its text_output (the prompt, then the completion)."""
    sampling = sampling.encode() if isinstance(sampling, str) else sampling
    req = proto.kserve("ModelInferRequest")(model_name="tiny", id="x")
    for name, value in (("text_input", PROMPT.encode()), ("sampling_parameters", sampling)):
        req.inputs.add(name=name, datatype="BYTES", shape=[1])
        req.raw_input_contents.append(encode_bytes([value]))
    with grpc.insecure_channel(target) as ch:
        data = ch.unary_unary(f"/{proto.KSERVE_SERVICE}/ModelInfer")(req.SerializeToString(), timeout=30)
    resp = proto.kserve("ModelInferResponse").FromString(data)
    return decode_bytes(resp.raw_output_contents[0], "text_output")[0].decode()


def still_serving(server: ServerThread, greedy: str) -> None:
    with BatonClient(server.target, timeout=30) as c:
        assert c.complete(PROMPT, max_tokens=TOKENS, temperature=0).completions[0].text == greedy
        assert c.health() == "SERVING"


def js(**kw) -> str:
    return json.dumps({"max_tokens": TOKENS, **kw})


AS_GREEDY = {  # sampling that can only pick the top token: the output is the greedy reference
    "temperature 1e-300": js(temperature=1e-300),
    "temperature 5e-324": js(temperature=5e-324),
    "temperature 1e-300 as a string": js(temperature="1e-300"),
    "top_p 1e-300": js(temperature=1.0, top_p=1e-300),
    "top_p 5e-324": js(temperature=1.0, top_p=5e-324),
    "min_p 1": js(temperature=1.0, min_p=1.0),
}

SERVED = {  # numerically extreme but admitted: served, reproducibly when seeded
    "repetition_penalty 1e300": js(temperature=1.0, repetition_penalty=1e300, seed=1),
    "repetition_penalty 1e-300": js(temperature=1.0, repetition_penalty=1e-300, seed=1),
    "temperature 1e300": js(temperature=1e300, seed=2),
    "top_k past the vocab": js(temperature=1.0, top_k=2**31 - 1, seed=3),
    "seed int64 max": js(temperature=1.0, seed=I64),
    "seed int64 min": js(temperature=1.0, seed=-I64 - 1),
    "seed int64 max, n 4": js(temperature=1.0, seed=I64, n=4),
}

REFUSED = {  # sampling_parameters JSON -> words the INVALID_ARGUMENT message must contain
    "temperature NaN": (js(temperature=float("nan")), "temperature must be a finite number"),
    "temperature 'nan'": (js(temperature="nan"), "temperature must be a finite number"),
    "temperature 1e400": ('{"temperature": 1e400}', "temperature must be a finite number"),
    "temperature -inf": (js(temperature="-inf"), "temperature must be a finite number"),
    "temperature past float": ('{"temperature": 1' + "0" * 400 + "}", "sampling_parameters.temperature"),
    "top_p NaN": (js(top_p=float("nan")), "top_p must be a finite number"),
    "repetition_penalty inf": (js(repetition_penalty=float("inf")), "repetition_penalty must be a finite number"),
    "n 100000": (js(n=100000), "--max-n"),
    "n 1.5": (js(n=1.5), "sampling_parameters.n"),
    "max_tokens 1e300": (js(max_tokens=1e300), "max_tokens"),
    "1000 stop strings": (js(stop=[f"s{i}" for i in range(1000)]), "--max-stop-strings"),
    "a 1000-character stop string": (js(stop=["x" * 1000]), "--max-stop-chars"),
    "100 stop token ids": (js(stop_token_ids=list(range(100))), "--max-stop-token-ids"),
    "seed 2**63": (js(seed=2**63), "seed must be in the int64 range"),
    "seed -2**63-1": (js(seed=-(2**63) - 1), "seed must be in the int64 range"),
    "seed 1e30 as a string": (js(seed="1" + "0" * 30), "seed must be in the int64 range"),
    "a 5000-digit integer": ('{"seed": ' + "9" * 5000 + "}", "sampling_parameters is not valid JSON"),
}


@pytest.mark.parametrize("case", list(AS_GREEDY))
def test_kserve_tiny_temperature_and_top_p_give_the_greedy_output(server, greedy, case):
    assert kserve(server.target, AS_GREEDY[case]) == PROMPT + greedy
    still_serving(server, greedy)


@pytest.mark.parametrize("case", list(SERVED))
def test_kserve_extreme_numerics_are_served_reproducibly(server, greedy, case):
    first = kserve(server.target, SERVED[case])
    assert first.startswith(PROMPT) and first == kserve(server.target, SERVED[case])
    still_serving(server, greedy)


@pytest.mark.parametrize("case", list(REFUSED))
def test_kserve_bounds_are_refused_by_name(server, greedy, case):
    sampling, words = REFUSED[case]
    with pytest.raises(grpc.RpcError) as e:
        kserve(server.target, sampling)
    assert e.value.code() == BAD and words in e.value.details(), e.value.details()
    still_serving(server, greedy)


@pytest.mark.parametrize(
    "sampling, words",
    [
        (dict(temperature=float("nan")), "temperature must be a finite number"),
        (dict(min_p=float("inf")), "min_p must be a finite number"),
        (dict(n=100000, temperature=1.0), "--max-n"),
        (dict(stop=["x"] * 1000), "--max-stop-strings"),
        (dict(logprobs=-1), "logprobs"),
        (dict(top_k=-2), "top_k"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_baton_bounds_are_refused_by_name(server, greedy, sampling, words):
    with BatonClient(server.target, timeout=30) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.complete(PROMPT, max_tokens=TOKENS, **sampling)
    assert e.value.code() == BAD and words in e.value.details(), e.value.details()
    still_serving(server, greedy)


def test_baton_extremes_are_served(server, greedy):
    with BatonClient(server.target, timeout=30) as c:
        for sampling in (dict(temperature=1e-300), dict(temperature=1.0, top_p=5e-324)):
            assert c.complete(PROMPT, max_tokens=TOKENS, **sampling).completions[0].text == greedy
        for seed in (I64, -I64 - 1):
            runs = [
                [
                    list(x.token_ids)
                    for x in c.complete(PROMPT, max_tokens=TOKENS, temperature=1.0, seed=seed, n=2).completions
                ]
                for _ in range(2)
            ]
            assert runs[0] == runs[1] and len(runs[0]) == 2
        with pytest.raises(ValueError):  # past int64 the proto itself refuses, client-side
            generate_request(PROMPT, seed=2**63)
        info = c.server_info()
        assert info.engine_requests == 0 and info.kv_blocks_free == info.kv_blocks_total, info
    still_serving(server, greedy)


def test_baton_serve_flags_set_the_bounds(monkeypatch, llama_dir):
    configs = []
    monkeypatch.setattr(server_module, "run", lambda config: configs.append(config) or 0)
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            str(llama_dir),
            "--max-n",
            "2",
            "--max-stop-strings",
            "1",
            "--max-stop-chars",
            "3",
            "--max-stop-token-ids",
            "4",
        ]
    )
    assert args.func(args) == 0
    args = build_parser().parse_args(["serve", "--model", str(llama_dir)])
    args.func(args)

    def bounds(limits: Limits) -> tuple[int, ...]:
        return limits.max_n, limits.max_stop_strings, limits.max_stop_string_chars, limits.max_stop_token_ids

    assert bounds(configs[0].limits) == (2, 1, 3, 4)
    assert bounds(configs[1].limits) == bounds(Limits())  # the flags' defaults are the Limits defaults
