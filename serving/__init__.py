"""The protocol-neutral serving core below both fronts (gRPC, HTTP) and above both engines: request
records and stream events, validation and assembly (``prepare``), admission, the one prompt renderer,
tool-call formats, the error vocabulary and the async seam to the engines (docs/architecture.md)."""
