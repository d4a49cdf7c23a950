"""Per-tenant drafting settings on disk: ``<data_dir>/tenants/<tenant>/drafting.json``.

``reprise tune`` writes the best setting it found; the service reads every tenant's at start-up
(``apply_tenant_configs``). The data directory is the ``data_dir`` argument, else ``$REPRISE_HOME``, else ``~/.reprise``.
Writes are atomic (``fileio.write_atomic``): a crash leaves the old file or the new one, never half of one.

File layout::

    {"drafting": {"max_draft_tokens": 32, ...}, "meta": {...}}

``drafting`` holds ``DraftingConfig`` fields; fields missing from the file take their defaults (so a
file written before a field existed still loads); a field the code no longer knows is an error naming
the file. ``meta`` is free-form (who wrote it, when, from which traces).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from fileio import reprise_home, write_atomic
from privacy.tenants import validate_tenant_name
from retrieval.config import DraftingConfig

FILE_NAME = "drafting.json"
log = logging.getLogger(__name__)


def data_dir_path(data_dir: str | Path | None = None) -> Path:
    """``data_dir``, else ``$REPRISE_HOME``, else ``~/.reprise``."""
    if data_dir is not None:
        return Path(data_dir).expanduser()
    return reprise_home()


def drafting_config_path(tenant: str, data_dir: str | Path | None = None) -> Path:
    """Where the tenant's drafting settings live; raises ValueError for an invalid tenant name."""
    validate_tenant_name(tenant)
    return data_dir_path(data_dir) / "tenants" / tenant / FILE_NAME


def save_drafting_config(
    tenant: str, config: DraftingConfig, data_dir: str | Path | None = None, *, meta: dict[str, Any] | None = None
) -> Path:
    """Write ``config`` as the tenant's drafting settings, atomically; returns the file's path."""
    if not isinstance(config, DraftingConfig):
        raise TypeError(f"config must be a DraftingConfig, got {type(config).__name__}")
    path = drafting_config_path(tenant, data_dir)
    body = json.dumps({"drafting": config.to_dict(), "meta": meta or {}}, indent=2, sort_keys=True) + "\n"
    write_atomic(path, body)
    return path


def load_drafting_config(tenant: str, data_dir: str | Path | None = None) -> DraftingConfig | None:
    """The tenant's saved drafting settings, or None when none were saved.

    A file that is not valid JSON or holds invalid settings raises ValueError naming the file.
    """
    path = drafting_config_path(tenant, data_dir)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("drafting"), dict):
            raise TypeError("expected an object with a 'drafting' object")
        return DraftingConfig.from_dict(data["drafting"])
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: invalid drafting settings: {exc}") from None


def apply_tenant_configs(proposer: Any, tenants: Any, data_dir: str | Path | None = None) -> int:
    """Give ``proposer`` each tenant's saved settings (by tenant name; the proposer knows tenants by
    id); returns how many tenants have their own. A file that cannot be read is logged and the tenant
    drafts with the service's settings. Proposers without per-tenant settings are left alone."""
    if not hasattr(proposer, "set_tenant_config"):
        return 0
    count = 0
    for tenant in tenants:
        try:
            config = load_drafting_config(tenant.name, data_dir)
        except (OSError, ValueError) as exc:
            log.error("tenant %s: its drafting settings are not used (%s)", tenant.name, exc)
            continue
        if config is not None:
            proposer.set_tenant_config(tenant.id.value, config)
            count += 1
    return count
