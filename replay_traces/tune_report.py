"""The files ``reprise tune`` writes: a PNG of the sweep and a self-contained HTML report.

The PNG has three panels per setting: tau, estimated speedup, and acceptance by draft position. The
HTML page embeds the same PNG as a base64 data URI plus the tables, with no external resource (no
script, stylesheet, font or image fetched from anywhere), so it can be mailed or archived as one file.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fileio import write_atomic
from replay_traces.tune import TuneResult, setting_label

_MAX_CURVES = 8  # acceptance-by-position curves drawn (the best settings by estimated speedup)


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` as indented JSON, atomically."""
    write_atomic(path, (json.dumps(payload, indent=2) + "\n").encode("utf-8"))


def _short(label: str, width: int = 60) -> str:
    """A legend label cut to ``width`` characters (one setting varies every field: a very long label
    would squeeze the plot to nothing); the table has it whole."""
    return label if len(label) <= width else label[: width - 1] + "\u2026"


def render_png(results: Sequence[TuneResult], best: TuneResult, title: str) -> bytes:
    """The sweep as a PNG (matplotlib, Agg backend): tau, estimated speedup, acceptance by position."""
    import matplotlib  # imported here: slow to load (reprise --help imports this module), backend first

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    n = len(results)
    xs = list(range(1, n + 1))
    colors = ["tab:orange" if r is best else "tab:blue" for r in results]
    fig, axes = plt.subplots(3, 1, figsize=(max(8.0, 0.45 * n + 3), 11), constrained_layout=True)
    fig.suptitle(title)
    ax = axes[0]
    ax.bar(xs, [r.pooled.tau for r in results], color=colors)
    ax.set_ylabel("tau (tokens / step)")
    ax.set_xticks(xs)
    ax.set_xlabel("setting # (see the table; orange = best)")
    ax = axes[1]
    ax.bar(xs, [r.estimated_speedup for r in results], color=colors)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("estimated speedup")
    ax.set_xticks(xs)
    ax.set_xlabel("setting #")
    ax = axes[2]
    ranked = sorted(range(n), key=lambda i: -results[i].estimated_speedup)[:_MAX_CURVES]
    for i in ranked:
        curve = results[i].pooled.acceptance_by_position
        ax.plot(range(1, len(curve) + 1), curve, marker=".", linewidth=2.2 if results[i] is best else 1.0,
                label=_short(f"#{i + 1} {setting_label(results[i].varied)}"))
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(accept >= k | draft)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if ranked:
        ax.legend(fontsize=7, loc="upper right")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], highlight: int | None = None) -> str:
    esc = html.escape
    out = ["<table>", "<tr>" + "".join(f"<th>{esc(str(h))}</th>" for h in header) + "</tr>"]
    for i, row in enumerate(rows):
        cls = ' class="best"' if i == highlight else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{esc(str(c))}</td>" for c in row) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def render_html(results: Sequence[TuneResult], best: TuneResult, png: bytes, *, title: str,
                details: Mapping[str, Any]) -> str:
    """A self-contained HTML report: summary, the PNG inline, the settings table, per-file figures."""
    esc = html.escape
    best_index = next(i for i, r in enumerate(results) if r is best)
    varied = list(results[0].varied) if results else []
    rows = []
    for i, r in enumerate(results):
        p = r.pooled
        rows.append([i + 1, *[r.varied[k] for k in varied], f"{p.tau:.3f}", f"{p.draft_tokens_per_step:.2f}",
                     f"{p.acceptance_rate:.3f}", f"{p.hit_rate:.3f}", f"{r.estimated_speedup:.3f}",
                     f"{p.speculate_us_p50:.1f}", f"{p.speculate_us_p99:.1f}"])
    settings_table = _table(["#", *varied, "tau", "draft/step", "accept", "hit", "est. speedup", "spec p50 us",
                             "spec p99 us"], rows, highlight=best_index)
    file_rows = []
    for i, r in enumerate(results):
        for f in r.files:
            file_rows.append([i + 1, Path(f.path).name, f.calls, f.tokens, f.steps, f"{f.tau:.3f}",
                              f"{f.draft_tokens_per_step:.2f}", f"{f.acceptance_rate:.3f}", f"{f.hit_rate:.3f}"])
    files_table = _table(["#", "file", "calls", "tokens", "steps", "tau", "draft/step", "accept", "hit"], file_rows)
    detail_rows = [[k, v if isinstance(v, str) else json.dumps(v)] for k, v in details.items()]
    detail_table = _table(["run", "value"], detail_rows)
    image = base64.b64encode(png).decode("ascii")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{esc(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }}
th {{ background: #f0f0f0; }}
tr.best td {{ background: #ffe7c2; font-weight: bold; }}
img {{ max-width: 100%; }}
</style>
</head>
<body>
<h1>{esc(title)}</h1>
<p>Best setting (highest estimated speedup): <b>#{best_index + 1} {esc(setting_label(best.varied))}</b>,
tau {best.pooled.tau:.3f}, estimated speedup {best.estimated_speedup:.3f}.</p>
<p>Estimated speedup = tau &times; a / (a + b &times; draft tokens per step): a verification step
checking d draft tokens costs a + b&middot;d, a plain decoding step costs a. Acceptance by position k =
steps that accepted at least k draft tokens / steps with a non-empty draft.</p>
{detail_table}
<h2>Settings</h2>
{settings_table}
<h2>Plots</h2>
<img alt="tau, estimated speedup and acceptance by position per setting" src="data:image/png;base64,{image}">
<h2>Per file</h2>
{files_table}
</body>
</html>
"""


def write_report(out_dir: Path, results: Sequence[TuneResult], best: TuneResult, *, title: str,
                 details: Mapping[str, Any]) -> tuple[Path, Path]:
    """Write ``tune.png`` and ``tune.html`` into ``out_dir``; returns their paths."""
    png = render_png(results, best, title)
    png_path, html_path = out_dir / "tune.png", out_dir / "tune.html"
    write_atomic(png_path, png)
    write_atomic(html_path, render_html(results, best, png, title=title, details=details).encode("utf-8"))
    return png_path, html_path
