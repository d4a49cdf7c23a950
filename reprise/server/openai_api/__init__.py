"""The OpenAI-compatible HTTP API (``/v1``): chat completions with tools and structured output,
completions, models; served by ``reprise.server.http`` beside /metrics and the dashboard."""

from __future__ import annotations

from reprise.server.openai_api.routes import openai_router

__all__ = ["openai_router"]
