"""Aligned text tables, as the commands print them."""

from __future__ import annotations


def columns(rows) -> str:
    """Rows of cells as aligned text columns (first column left-aligned, the others right-aligned)."""
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)
