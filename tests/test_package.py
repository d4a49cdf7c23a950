"""The package imports and the CLI answers --help."""

from __future__ import annotations

import subprocess
import sys


def test_cli_help_lists_commands() -> None:
    out = subprocess.run([sys.executable, "-m", "reprise", "--help"], capture_output=True, text=True, check=True)
    assert "usage: reprise" in out.stdout


def test_native_module_loads() -> None:
    from suffix_index import _native

    assert _native.ABI_VERSION >= 1
