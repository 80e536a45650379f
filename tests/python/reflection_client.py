"""Lists a gRPC server's services with Python's `grpcio-reflection` client (which speaks
reflection v1alpha), as `grpcurl`-less Python users do. Usage: reflection_client.py HOST:PORT
Prints the service names, one per line."""

import sys

import grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

with grpc.insecure_channel(sys.argv[1]) as channel:
    database = ProtoReflectionDescriptorDatabase(channel)
    for service in database.get_services():
        print(service)
