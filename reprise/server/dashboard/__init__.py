"""The built-in hit-rate dashboard and the service's HTTP endpoints (/metrics, /healthz, /dashboard).

``StatsHistory`` samples per-tenant statistics over time; ``HttpServer`` serves the page (inline SVG
charts, no external scripts) and its JSON, the latter only to admin keys.
"""

from __future__ import annotations

from reprise.server.dashboard.history import StatsHistory, interval_point
from reprise.server.dashboard.http import HttpServer

__all__ = ["HttpServer", "StatsHistory", "interval_point"]
