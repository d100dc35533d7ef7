"""report/index.html: the run's curves, its per-iteration table and sample completions in one
self-contained page (the PNG is embedded as a data URI, no script, no external resource), so it
can be opened from disk, copied, or served as is. While the run goes on the page reloads itself.
"""

from __future__ import annotations

import base64
from html import escape
from typing import Any

from rlpipe.pipelines.display import COLUMNS, NOTE, format_value

#: Seconds between reloads of the page of a running run.
REFRESH_SECONDS = 15

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.5em; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f0f0f0; }
td.text { font-family: ui-monospace, monospace; white-space: pre-wrap; max-width: 30em; }
img { max-width: 100%; }
.scroll { overflow-x: auto; }
.note { color: #555; font-size: 0.9em; }
"""


def render_html(run: str, table, png: bytes, initial: dict[str, float],
                samples: tuple[int, Any] | None, *, live: bool) -> str:
    """The page: title and status, curves, held-out before training, the table, and the sample
    completions of `samples` = (shown iteration, frame of prompt/response/reward/...)."""
    status = f"running: this page reloads every {REFRESH_SECONDS} s" if live else "finished"
    parts = ["<!DOCTYPE html>", "<html><head><meta charset='utf-8'>",
             f"<title>rlpipe run {escape(run)}</title>"]
    if live:
        parts.append(f"<meta http-equiv='refresh' content='{REFRESH_SECONDS}'>")
    parts += [f"<style>{_STYLE}</style></head><body>",
              f"<h1>rlpipe run {escape(run)}</h1>",
              f"<p id='status'>{escape(status)}; {table.height} iteration(s)</p>",
              f"<img id='curves' alt='training curves' src='data:image/png;base64,"
              f"{base64.b64encode(png).decode()}'>",
              f"<p class='note'>{escape(NOTE)}</p>"]
    if initial:
        parts.append("<p>Held-out before training: "
                     + escape(", ".join(f"{k} {v:.3f}" for k, v in initial.items())) + "</p>")
    parts.append("<h2>Per iteration</h2>")
    if table.is_empty():
        parts.append("<p>(no iterations yet)</p>")
    else:
        head = "".join(f"<th title='{escape(COLUMNS.get(c, (c, c))[1])}'>{escape(c)}</th>" for c in table.columns)
        body = "".join("<tr>" + "".join(f"<td class='num'>{escape(format_value(v))}</td>" for v in row) + "</tr>"
                       for row in table.iter_rows())
        parts.append(f"<div class='scroll'><table id='iterations'><thead><tr>{head}</tr></thead>"
                     f"<tbody>{body}</tbody></table></div>")
    if samples is not None:
        n, frame = samples
        parts.append(f"<h2>Sample completions, iteration {n}</h2>")
        head = "".join(f"<th>{escape(c)}</th>" for c in frame.columns)
        body = "".join(
            "<tr>" + "".join(f"<td class='{'num' if isinstance(v, float) else 'text'}'>{escape(format_value(v))}</td>"
                             for v in row) + "</tr>"
            for row in frame.iter_rows())
        parts.append(f"<table id='samples'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
    parts.append("</body></html>")
    return "\n".join(parts)
