"""reprise.v1 protos and their generated code (python -m grpc_api.codegen rewrites the *_pb2* files)."""
