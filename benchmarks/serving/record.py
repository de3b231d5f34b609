"""Reading the comparison's JSON record: its cells, and one figure over a cell's repeats.
Both the report and the plots read it this way."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from typing import Any

Cells = dict[tuple[str, str, int], list[dict[str, Any]]]


def grouped(record: dict[str, Any]) -> Cells:
    """Cells by (peer, workload, concurrency): one entry per repeat."""
    cells: Cells = defaultdict(list)
    for entry in record["results"]:
        cells[entry["peer"], entry["workload"], entry["concurrency"]].append(entry)
    return cells


def median(
    entries: list[dict[str, Any]], get: Callable[[dict[str, Any]], float | None]
) -> float | None:
    """Median over the repeats of a cell of one summary figure; None if none had it."""
    values = [v for e in entries if (v := get(e["summary"])) is not None]
    return statistics.median(values) if values else None
