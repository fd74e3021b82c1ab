"""Shared output of the benchmarks: a rich table on the console and the JSON results file."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table


def report(console: Console, title: str, results: list[dict], columns: list[tuple[str, str, str]], out: str,
           note: str) -> None:
    """columns: (header, result key, format spec); None values print as '-'."""
    table = Table(title=title)
    for i, (header, _, _) in enumerate(columns):
        table.add_column(header, justify="left" if i == 0 else "right")
    for r in results:
        table.add_row(*("-" if r.get(key) is None else format(r[key], spec) for _, key, spec in columns))
    console.print(table)
    console.print(note)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"wrote {out}")


def merged(path: str, fresh: list[dict]) -> list[dict]:
    """The results file's rows with those of a partial run put in place of the same cases."""
    old = json.loads(Path(path).read_text()) if Path(path).exists() else []
    by_case = {r["case"]: r for r in fresh}
    out = [by_case.pop(r["case"], r) for r in old]
    return out + list(by_case.values())


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of fn takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def spread(paired: list[tuple[float, float]]) -> dict:
    """A case's spread on this shared machine, from each rep's (seconds, baseline seconds) run
    one just after the other: the range of the reps' ratios (baseline / case)."""
    ratios = sorted(b / t for t, b in paired)
    return {"reps": len(paired), "ratio_min": ratios[0], "ratio_max": ratios[-1],
            "ratio_range": f"{ratios[0]:.2f}-{ratios[-1]:.2f}"}


RATE_COLUMNS = [("case", "case", ""), ("seconds", "seconds", ".4f"), ("GB/s", "gbps", ".2f"),
                ("baseline GB/s", "baseline_gbps", ".2f"), ("ratio", "ratio", ".2f")]


def report_merged(console: Console, title: str, results: list[dict], columns: list[tuple[str, str, str]],
                  out: str, note: str) -> None:
    """The table of a partial run, its cases merged into the results file `out` (the others stay)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as tmp:
        report(console, title, results, columns, tmp.name, note)
    Path(out).write_text(json.dumps(merged(out, results), indent=2) + "\n")
    console.print(f"merged into {out}")
