"""A log line per interval for events that come in floods (refused connections, refused calls): the
count and one example, never a line per event, so that an attacker cannot fill the log or slow the
event loop with it."""

from __future__ import annotations

import logging
import time


class StormLog:
    """Counts a kind of event and logs it once per ``interval_s`` with the count, not once per event."""

    def __init__(self, logger: logging.Logger, message: str, interval_s: float = 60.0) -> None:
        self.logger = logger
        self.message = message
        self.interval_s = interval_s
        self.total = 0
        self._since_report = 0
        self._last = -float("inf")

    def hit(self, detail: str = "") -> None:
        self.total += 1
        self._since_report += 1
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self.logger.warning("%s (%d in the last %.0f s%s)", self.message, self._since_report,
                                min(now - self._last, self.interval_s), f"; {detail}" if detail else "")
            self._last = now
            self._since_report = 0
