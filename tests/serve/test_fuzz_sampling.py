"""Property test: no sampling parameter the wire admits can hurt anyone but its own call.

Hypothesis draws sampling parameters from the whole range the proto (Baton's API) and Triton's
JSON (KServe) admit — extremes, NaN/inf, subnormal and huge floats, int32/int64 edges, ints past
int64, long stop lists — and sends them to one real `baton serve` subprocess while ordinary greedy
streams run beside them. Every fuzzed call must end OK or with a client error code, every ordinary
stream must equal the offline engine's greedy output, and afterwards the KV pool is whole and
health is SERVING. Bounded: a fixed number of examples, small server limits.
"""

from __future__ import annotations

import json
import math
import threading

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.serve import proto
from baton.serve.client import BatonClient, generate_request
from baton.serve.kserve_tensors import encode_bytes

from .server_fixtures import PROMPTS, ServerProcess, offline

pytestmark = pytest.mark.slow

CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE}
I32, I64 = 2**31 - 1, 2**63 - 1
EXAMPLES = 120  # per API; a call is refused or served in milliseconds, so this stays within seconds
ORDINARY_TOKENS = 24

EDGE_FLOATS = [
    0.0,
    -0.0,
    5e-324,
    1e-300,
    1e-6,
    1e-5,
    0.5,
    1.0,
    2.0,
    1e300,
    -1e-300,
    -1.0,
    -1e300,
    math.inf,
    -math.inf,
    math.nan,
    1.7976931348623157e308,
]
floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(allow_nan=True, allow_infinity=True))
int32s = st.one_of(st.sampled_from([-I32 - 1, -1, 0, 1, 2, 3, 16, 100000, I32]), st.integers(-I32 - 1, I32))
int64s = st.one_of(st.sampled_from([-I64 - 1, -1, 0, 1, I64]), st.integers(-I64 - 1, I64))
texts = st.text(max_size=8)
stops = st.one_of(
    st.lists(texts, max_size=4),
    st.lists(st.text(min_size=1, max_size=2), min_size=200, max_size=300),
    st.lists(st.text(min_size=5000, max_size=5001), min_size=1, max_size=1),
)

PROTO_FIELDS = dict(
    n=int32s,
    max_tokens=st.one_of(st.integers(1, 12), int32s),
    temperature=floats,
    top_k=int32s,
    top_p=floats,
    min_p=floats,
    repetition_penalty=floats,
    presence_penalty=floats,
    frequency_penalty=floats,
    seed=int64s,
    stop=stops,
    stop_token_ids=st.lists(int32s, max_size=3),
    include_stop_str_in_output=st.booleans(),
    ignore_eos=st.booleans(),
    logprobs=int32s,
    skip_special_tokens=st.booleans(),
)
# Mostly-valid draws too, so that accepted calls explore the numeric edges of the sampler itself.
tiny_or_huge = st.sampled_from([5e-324, 1e-300, 1e-30, 1e-6, 9.99e-6, 1e-5, 1.0, 1e6, 1e300])
SERVABLE = dict(
    n=st.integers(1, 4),
    max_tokens=st.integers(1, 12),
    temperature=st.one_of(tiny_or_huge, st.just(0.0)),
    top_k=st.sampled_from([-1, 0, 1, 2, 10**6]),
    top_p=st.one_of(tiny_or_huge.filter(lambda x: x <= 1)),
    min_p=st.sampled_from([0.0, 5e-324, 1e-300, 0.5, 1.0]),
    repetition_penalty=st.one_of(tiny_or_huge),
    presence_penalty=st.sampled_from([-2.0, 0.0, 2.0]),
    frequency_penalty=st.sampled_from([-2.0, 0.0, 2.0]),
    seed=int64s,
    stop=st.lists(st.text(min_size=1, max_size=4), max_size=3),
    logprobs=st.sampled_from([0, 1, 20]),
)
proto_params = st.one_of(st.fixed_dictionaries({}, optional=PROTO_FIELDS), st.fixed_dictionaries({}, optional=SERVABLE))

# JSON admits more than the proto: ints past int64, floats as strings, wrong types, nulls.
json_scalars = st.one_of(
    floats.filter(math.isfinite),
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.none(),
    texts,
    st.sampled_from(["nan", "inf", "-inf", "1e400", "1e-400", "0x10", "", "3"]),
)
json_params = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            **{
                k: st.one_of(v.filter(lambda x: not isinstance(x, float) or math.isfinite(x)), json_scalars)
                for k, v in PROTO_FIELDS.items()
            },
            "stop": st.one_of(stops, json_scalars, st.lists(json_scalars, max_size=3)),
        },
    ),
    st.fixed_dictionaries({}, optional=SERVABLE),
)


def _json(params: dict) -> bytes:
    # NaN/inf are not JSON; Python's encoder writes NaN/Infinity, which is what careless clients send
    return json.dumps(params, allow_nan=True).encode()


def kserve_request(prompt: str, sampling: bytes, stream: bool):
    req = proto.kserve("ModelInferRequest")(model_name="tiny", id="fuzz")
    for name, dtype, value in (
        ("text_input", "BYTES", prompt.encode()),
        ("sampling_parameters", "BYTES", sampling),
        ("stream", "BOOL", stream),
    ):
        req.inputs.add(name=name, datatype=dtype, shape=[1])
        req.raw_input_contents.append(bytes([value]) if dtype == "BOOL" else encode_bytes([value]))
    return req


@pytest.fixture(scope="module")
def served(llama_dir, tmp_path_factory):
    server = ServerProcess(
        tmp_path_factory.mktemp("fuzz"),
        "--model",
        str(llama_dir),
        "--model-name",
        "tiny",
        "--num-kv-blocks",
        "96",
        "--block-size",
        "8",
        "--max-output-tokens",
        "32",
        "--max-n",
        "4",
        "--max-num-seqs",
        "16",
    )
    outcomes: dict[str, int] = {}
    ordinary = Ordinary(server.target, llama_dir)
    ordinary.start()
    yield server, outcomes, ordinary
    ordinary.stop()
    assert server.terminate() == 0, server.log()


class Ordinary:
    """Greedy streams sent in a loop beside the fuzzed calls; each checked against the offline engine."""

    def __init__(self, target: str, model_dir):
        self.target = target
        self.reference = {p: text for p, (_, text, _) in zip(PROMPTS, offline(model_dir, PROMPTS, ORDINARY_TOKENS))}
        self.done = self.wrong = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(2)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _loop(self, k: int) -> None:
        with BatonClient(self.target, timeout=60) as c:
            i = k
            while not self._stop.is_set():
                prompt = PROMPTS[i % len(PROMPTS)]
                try:
                    text = "".join(
                        comp.text
                        for msg in c.generate(prompt, max_tokens=ORDINARY_TOKENS, temperature=0)
                        for comp in msg.completions
                    )
                except grpc.RpcError as e:
                    self.errors.append(f"{e.code().name}: {e.details()}")
                    continue
                self.done += 1
                self.wrong += text != self.reference[prompt]
                i += 2

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)


def _outcome(outcomes: dict[str, int], fn) -> None:
    try:
        fn()
        code = grpc.StatusCode.OK
    except grpc.RpcError as e:
        code = e.code()
        assert code in CLIENT_ERRORS, f"{code.name}: {e.details()}"
        assert e.details(), "a refusal must say why"
    outcomes[code.name] = outcomes.get(code.name, 0) + 1


SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@SETTINGS
@given(params=proto_params, prompt=st.sampled_from(PROMPTS), unary=st.booleans())
def test_baton_api_any_sampling_params(served, params, prompt, unary):
    server, outcomes, _ = served
    with grpc.insecure_channel(server.target) as ch:
        request = generate_request(prompt, unary=unary, **params).SerializeToString()
        _outcome(outcomes, lambda: list(ch.unary_stream(f"/{proto.BATON_SERVICE}/Generate")(request, timeout=60)))


@SETTINGS
@given(params=json_params, prompt=st.sampled_from(PROMPTS), stream=st.booleans())
def test_kserve_any_sampling_parameters(served, params, prompt, stream):
    server, outcomes, _ = served
    with grpc.insecure_channel(server.target) as ch:
        if stream:
            infer = ch.stream_stream(f"/{proto.KSERVE_SERVICE}/ModelStreamInfer")
            request = kserve_request(prompt, _json(params), True).SerializeToString()

            def run():
                for resp in infer(iter([request]), timeout=60):
                    msg = proto.kserve("ModelStreamInferResponse").FromString(resp)
                    if msg.error_message:
                        raise _StreamError(msg.error_message)

            try:
                _outcome(outcomes, run)
            except _StreamError as e:  # a stream reports a refused request in-band, as Triton does
                outcomes["stream_error"] = outcomes.get("stream_error", 0) + 1
                assert not any(w in str(e) for w in ("internal error", "restarted", "shutting down")), str(e)
        else:
            request = kserve_request(prompt, _json(params), False).SerializeToString()
            _outcome(outcomes, lambda: ch.unary_unary(f"/{proto.KSERVE_SERVICE}/ModelInfer")(request, timeout=60))


class _StreamError(Exception):
    pass


def test_after_the_fuzz_the_server_is_whole(served):
    server, outcomes, ordinary = served
    ordinary.stop()
    assert sum(outcomes.values()) >= EXAMPLES, outcomes  # both property tests ran against this server
    assert outcomes.get("OK", 0) >= EXAMPLES // 4 and outcomes.get("INVALID_ARGUMENT", 0) > 0, outcomes
    assert not ordinary.errors, ordinary.errors[:3]
    assert ordinary.done > 0 and ordinary.wrong == 0, (ordinary.done, ordinary.wrong)
    with BatonClient(server.target, timeout=30) as c:
        assert c.health() == "SERVING"
        info = c.server_info()
        assert info.engine_requests == 0 and info.kv_blocks_free == info.kv_blocks_total, info
    print(f"fuzz outcomes: {outcomes}; ordinary streams: {ordinary.done} correct of {ordinary.done}")
