"""Query results as a table on a terminal, or as JSON / CSV for machines (``--format``)."""

from __future__ import annotations

import csv
import json
import sys
from typing import Any, Sequence

from kvtrace.jsonable import jsonable


def print_rows(columns: Sequence[str], rows: Sequence[Sequence[Any]], fmt: str, out=None) -> None:
    out = out or sys.stdout
    if fmt == "json":
        json.dump([{c: jsonable(v) for c, v in zip(columns, row)} for row in rows], out, indent=2)
        out.write("\n")
        return
    if fmt == "csv":
        writer = csv.writer(out)
        writer.writerow(columns)
        for row in rows:
            writer.writerow([json.dumps(jsonable(v)) if isinstance(v, (list, dict)) else jsonable(v) for v in row])
        return
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    out.write("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip() + "\n")
    for row in cells:
        out.write("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() + "\n")
    if not rows:
        out.write("(no rows)\n")


def _cell(value: Any) -> str:
    value = jsonable(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        text = json.dumps(value)
        return text if len(text) <= 60 else text[:57] + "..."
    return "" if value is None else str(value)
