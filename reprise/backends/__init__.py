"""Decode backends: what the serving layer (gRPC and HTTP fronts) talks to through the
``grpc_api.backend.DecodeBackend`` protocol. ``engine`` runs Reprise's own engine on a thread."""
