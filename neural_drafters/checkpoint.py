"""Head checkpoints on disk, written so that a crash never leaves a half checkpoint that loads.

    OUT/LATEST                  the name of the newest complete checkpoint (replaced atomically)
    OUT/step-000400/config.json head config + training summary (held-out agreement, data, settings)
    OUT/step-000400/head.safetensors
    OUT/step-000400/trainer.pt  optimizer state, step, RNG states (for --resume)

A checkpoint is written into a temporary sibling folder, fsynced, renamed into place, and only then
named in ``LATEST``; older checkpoints beyond ``keep`` are deleted afterwards. ``OUT`` may also be a
checkpoint folder itself (``load_head("OUT/step-000400")``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fileio import atomic_writer, current_umask, fsync_dir, write_atomic
from neural_drafters.config import HeadConfig
from neural_drafters.heads import build_head

LATEST = "LATEST"
CONFIG = "config.json"
WEIGHTS = "head.safetensors"
TRAINER = "trainer.pt"


def save_checkpoint(out: str | Path, head: Any, *, step: int, summary: dict[str, Any] | None = None,
                    trainer_state: dict[str, Any] | None = None, keep: int = 2) -> Path:
    """Write a complete checkpoint of ``head`` at ``step`` under ``out``; returns its folder."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=out))
    try:
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes 0700; give the usual mode
        body = {"head": head.config.to_dict(), "step": step, "summary": summary or {}}
        write_atomic(tmp / CONFIG, json.dumps(body, indent=2, sort_keys=True) + "\n")
        state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS))
        with open(tmp / WEIGHTS, "rb+") as fh:
            os.fsync(fh.fileno())
        if trainer_state is not None:
            with atomic_writer(tmp / TRAINER) as fh:
                torch.save(trainer_state, fh)
        fsync_dir(tmp)
        final = out / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out)
    write_atomic(out / LATEST, name + "\n")
    steps = sorted(p for p in out.glob("step-*") if p.is_dir() and p.name != name)
    for old in steps[: max(0, len(steps) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_dir(path: str | Path) -> Path:
    """The checkpoint folder ``path`` names: itself if it holds a config, else the one in its LATEST.

    Raises FileNotFoundError saying what is missing.
    """
    path = Path(path)
    if (path / CONFIG).is_file():
        return path
    pointer = path / LATEST
    if not pointer.is_file():
        if not path.exists():
            raise FileNotFoundError(f"no draft head checkpoint at {str(path)!r}: the folder does not exist")
        raise FileNotFoundError(f"no draft head checkpoint in {str(path)!r}: no {LATEST} file and no {CONFIG}")
    folder = path / pointer.read_text().strip()
    if not (folder / CONFIG).is_file():
        raise FileNotFoundError(f"{pointer} names {folder.name!r}, which holds no {CONFIG}")
    return folder


def read_checkpoint_info(path: str | Path) -> dict[str, Any]:
    """The checkpoint's ``config.json`` (``head``, ``step``, ``summary``)."""
    folder = checkpoint_dir(path)
    try:
        return json.loads((folder / CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{folder / CONFIG}: unreadable checkpoint config: {exc}") from None


def load_head(path: str | Path) -> tuple[Any, dict[str, Any]]:
    """(head in eval mode, checkpoint info) from a checkpoint folder or its parent ``OUT``."""
    folder = checkpoint_dir(path)
    info = read_checkpoint_info(folder)
    config = HeadConfig.from_dict(info["head"])
    head = build_head(config)
    state = load_file(str(folder / WEIGHTS))
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{folder / WEIGHTS} does not match a {config.kind} head: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    return head.eval(), info


def load_trainer_state(path: str | Path) -> dict[str, Any] | None:
    """The optimizer/step/RNG state saved with the newest checkpoint, or None if it has none."""
    folder = checkpoint_dir(path)
    if not (folder / TRAINER).is_file():
        return None
    return torch.load(folder / TRAINER, weights_only=False)
