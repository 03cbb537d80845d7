"""Server pieces without a server: the KServe proto against tritonclient's own copy, the tensor
codec against tritonclient's serializer, sampling-parameter parsing, and admission control."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from baton.serve import proto
from baton.serve.admission import Admission
from baton.serve.kserve_tensors import decode_bytes, encode_bytes
from baton.serve.request_params import from_json, from_proto
from baton.serve.rpc import RpcError
from baton.serve.sampling_params import SamplingParams

service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2", reason="tritonclient[grpc] is a dev dependency")


def _fields(desc) -> list[tuple]:
    return sorted(
        (
            f.name,
            f.number,
            f.type,
            f.message_type.full_name if f.message_type else "",
            f.containing_oneof.name if f.containing_oneof else "",
            f.has_presence,
        )
        for f in desc.fields
    )


def test_kserve_proto_matches_tritonclients_descriptors():
    """Every message and method we define exists in tritonclient's grpc_service.proto, identically."""
    ours = proto.pool().FindFileByName("inference/grpc_service.proto")
    theirs = service_pb2.DESCRIPTOR

    def walk(desc):
        yield desc
        for nested in desc.nested_types:
            yield from walk(nested)

    checked = 0
    for top in ours.message_types_by_name.values():
        for desc in walk(top):
            ref = theirs.pool.FindMessageTypeByName(desc.full_name)
            assert _fields(desc) == _fields(ref), desc.full_name
            checked += 1
    assert checked >= 20
    ref_svc = theirs.services_by_name["GRPCInferenceService"]
    for m in ours.services_by_name["GRPCInferenceService"].methods:
        r = ref_svc.methods_by_name[m.name]
        assert (m.input_type.full_name, m.output_type.full_name) == (r.input_type.full_name, r.output_type.full_name)
        assert (m.client_streaming, m.server_streaming) == (r.client_streaming, r.server_streaming), m.name


def test_bytes_tensor_codec_matches_tritonclient():
    from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

    items = [b"", b"hello", "café 🦊".encode(), b"\x00\xff" * 300]
    raw = serialize_byte_tensor(np.array(items, dtype=object)).item()
    assert encode_bytes(items) == raw
    assert decode_bytes(raw, "x") == items
    assert list(deserialize_bytes_tensor(encode_bytes(items))) == items
    with pytest.raises(RpcError, match="truncated"):
        decode_bytes(raw[:-1], "x")


def test_sampling_from_proto_keeps_engine_defaults():
    msg = proto.baton("SamplingParams")(temperature=0.0, stop=["\n"], max_tokens=7)
    p = from_proto(msg)
    assert (p.temperature, p.stop, p.max_tokens) == (0.0, ["\n"], 7)
    assert (p.top_p, p.n, p.skip_special_tokens) == (SamplingParams().top_p, 1, True)  # unset: defaults
    with pytest.raises(RpcError, match="top_p"):
        from_proto(proto.baton("SamplingParams")(top_p=0.0))


def test_sampling_from_json():
    p = from_json(
        '{"temperature": "0", "max_tokens": "12", "top_k": 5, "stop": "x", "ignore_eos": "true", "seed": null}'
    )
    assert (p.temperature, p.max_tokens, p.top_k, p.stop, p.ignore_eos, p.seed) == (0.0, 12, 5, ["x"], True, None)
    for text, field in [
        ("{bad", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"tempature": 1}', "'tempature'"),
        ('{"max_tokens": "abc"}', "max_tokens"),
        ('{"temperature": -1}', "temperature"),
        ('{"ignore_eos": 3}', "ignore_eos"),
        ('{"max_tokens": 1.5}', "max_tokens"),
    ]:
        with pytest.raises(RpcError, match=field) as e:
            from_json(text)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_admission_queues_then_refuses_and_survives_cancellation():
    async def main():
        adm = Admission(max_running=2, max_queued=1)
        release = asyncio.Event()
        order: list[int] = []

        async def job(i: int):
            async with adm.slot():
                order.append(i)
                await release.wait()

        running = [asyncio.create_task(job(i)) for i in range(2)]
        await asyncio.sleep(0)
        waiter = asyncio.create_task(job(2))
        await asyncio.sleep(0)
        assert (adm.running, adm.queued) == (2, 1)
        with pytest.raises(RpcError) as e:
            async with adm.slot():
                pass
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        waiter.cancel()  # a queued call that gives up leaves no trace
        await asyncio.sleep(0)
        assert (adm.running, adm.queued) == (2, 0)
        late = asyncio.create_task(job(3))
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(*running, late)
        assert order == [0, 1, 3] and (adm.running, adm.queued) == (0, 0)

    asyncio.run(main())


def test_server_info_has_every_field_from_the_engine_stats_or_the_server():
    """ServerInfoResponse is built from EngineStats by name: every proto field must be one of its
    attributes or filled by the server itself, and no attribute may miss the proto."""
    import dataclasses
    import typing

    from baton.serve.baton_service import server_info_fields
    from baton.serve.core.stats import EngineStats
    from baton.serve.runtime import Limits, Runtime

    rt = Runtime("tiny", Limits())
    names = [f.name for f in dataclasses.fields(EngineStats)]
    sample = {list[int]: lambda i: [i + 1], str: str, int: lambda i: i + 1, float: lambda i: i + 1.5}
    hints = typing.get_type_hints(EngineStats)
    stats = EngineStats(**{name: sample[hints[name]](i) for i, name in enumerate(names)})
    fields = server_info_fields(rt, stats)
    response = proto.baton("ServerInfoResponse")
    assert set(fields) | {"coe"} == {f.name for f in response.DESCRIPTOR.fields}  # coe: serve/coe/ only
    msg = response(**fields)
    assert all(getattr(msg, name) == getattr(stats, name) for name in names)
    assert set(server_info_fields(rt, None)) == {"version", "uptime_s", "state", "failure_reason"}, "while loading"
