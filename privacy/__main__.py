"""``python -m privacy``: operator commands on the store (see privacy.admin_cli)."""

from __future__ import annotations

import logging
import sys

from privacy.admin_cli import main

logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
sys.exit(main())
