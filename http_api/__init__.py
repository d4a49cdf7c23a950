"""The HTTP front (FastAPI on uvicorn): the OpenAI-compatible API (Chat Completions, Completions,
Responses), /healthz, /metrics, and the routes the application adds (the dashboard); a thin adapter over
the serving core, as ``grpc_api`` is for gRPC (docs/openai_api.md)."""
