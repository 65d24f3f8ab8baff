"""Server reflection under both of its names: grpc.reflection.v1 and grpc.reflection.v1alpha.

grpcio-reflection (1.85) serves only v1alpha, which gRPC has deprecated (grpc/grpc#38576 asks for
v1 in Python); buf curl, grpcurl and Postman ask for v1 first and fall back. v1 is v1alpha's
protocol under a new package name: the same messages with the same field numbers, so the bytes
on the wire are identical. The v1 service here is therefore the library's own v1alpha servicer
registered under the v1 method name, its messages read and written by the v1alpha classes.

So that reflection can also describe itself under v1, the v1 file descriptor (derived from
v1alpha's: package, file name and options renamed, as in grpc-proto's grpc/reflection/v1) is
added to the default descriptor pool, which the reflection servicer reads.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA_PACKAGE = "grpc.reflection.v1alpha"
V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1ALPHA_SERVICE_NAME: str = reflection.SERVICE_NAME
METHOD = "ServerReflectionInfo"


def _v1_file_proto() -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.ClearField("options")  # v1alpha's are its own (deprecated, its Go and Java packages)
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    proto.options.java_multiple_files = True
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.java_outer_classname = "ServerReflectionProto"
    old, new = f".{V1ALPHA_PACKAGE}.", f".{V1_PACKAGE}."
    for message in proto.message_type:  # the file has no nested types, enums or extensions
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = new + field.type_name.removeprefix(old)
    for service in proto.service:
        for method in service.method:
            method.input_type = new + method.input_type.removeprefix(old)
            method.output_type = new + method.output_type.removeprefix(old)
    return proto


def v1_file_descriptor() -> FileDescriptor:
    """grpc/reflection/v1/reflection.proto in the default pool (added on the first call)."""
    pool = descriptor_pool.Default()
    try:
        return pool.FindFileByName(V1_FILE)
    except KeyError:
        pool.AddSerializedFile(_v1_file_proto().SerializeToString())
        return pool.FindFileByName(V1_FILE)


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection v1 and v1alpha on ``server``, listing ``service_names`` and both reflections."""
    v1_file_descriptor()
    servicer = reflection.aio.ReflectionServicer([*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {METHOD: v1})])
