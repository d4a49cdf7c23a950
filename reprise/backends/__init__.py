"""The decode backends the gRPC servicers talk to (``grpc_api.backend.DecodeBackend``)."""
