"""The built-in hit-rate dashboard: ``StatsHistory`` samples per-tenant statistics over time;
``dashboard_router`` serves the page (inline SVG charts, no external scripts) and its JSON, the latter
only to admin keys (on the HTTP app, ``http_api.app``)."""

from __future__ import annotations

from reprise.server.dashboard.history import StatsHistory, interval_point
from reprise.server.dashboard.http import dashboard_router

__all__ = ["StatsHistory", "dashboard_router", "interval_point"]
