"""The gRPC front: the protos (``v1/``), the server with its data and admin planes, interceptors, admission
and the Python clients. Imports grpc and protobuf, nothing of the application: ``backend`` holds the plain
records and protocols the application implements (docs/architecture.md, docs/service.md)."""
