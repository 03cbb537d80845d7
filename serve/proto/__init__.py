"""Baton's .proto files, compiled with grpcio-tools' protoc the first time they are needed.

No generated `_pb2.py` files exist, in the tree or on disk: protoc turns the .proto sources into
descriptors, which go into a *private* descriptor pool, and message classes are made from them.
Why: our KServe package is `inference`, the same as tritonclient's copy, and two copies of it
cannot share the default pool in one process (clients and servers live together in tests and
benchmarks); and no generated code means no gencode/runtime protobuf version pairing to drift.
The descriptors are also what server reflection hands to grpcurl.

`python -m baton.serve.proto OUT.pb` writes the descriptor set (imports included), for tools
that take one (`grpcurl -protoset`, Envoy's gRPC-JSON transcoder).
"""

from __future__ import annotations

import functools
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from grpc_tools import protoc

PROTO_ROOT = Path(__file__).parent
PROTO_FILES = ("baton/serve/v1/sampling.proto", "baton/serve/v1/baton.proto", "inference/grpc_service.proto")
BATON_SERVICE = "baton.serve.v1.BatonService"
KSERVE_SERVICE = "inference.GRPCInferenceService"


@functools.cache
def descriptor_set() -> descriptor_pb2.FileDescriptorSet:
    """Compile PROTO_FILES with the bundled protoc (raises RuntimeError with protoc's verdict)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "baton.pb"
        rc = protoc.main(["protoc", f"-I{PROTO_ROOT}", f"--descriptor_set_out={out}", "--include_imports",
                          *PROTO_FILES])
        if rc != 0:
            raise RuntimeError(f"protoc could not compile the .proto files under {PROTO_ROOT} (exit {rc}); "
                               "its message is above")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


@functools.cache
def pool() -> descriptor_pool.DescriptorPool:
    """Our files plus health and reflection (so reflection can describe every served service)."""
    p = descriptor_pool.DescriptorPool()
    for module in (health_pb2, reflection_pb2):
        fdp = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(fdp)
        p.Add(fdp)
    for fdp in descriptor_set().file:
        p.Add(fdp)
    return p


@functools.cache
def message(full_name: str) -> type[Message]:
    """The message class for a fully qualified name, e.g. 'baton.serve.v1.GenerateRequest'."""
    return message_factory.GetMessageClass(pool().FindMessageTypeByName(full_name))


def baton(name: str) -> type[Message]:
    return message(f"baton.serve.v1.{name}")


def kserve(name: str) -> type[Message]:
    return message(f"inference.{name}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m baton.serve.proto OUT.pb")
    Path(sys.argv[1]).write_bytes(descriptor_set().SerializeToString())
    print(f"wrote {sys.argv[1]} ({', '.join(PROTO_FILES)})")
