"""Fixed-width tables in the nccl-tests manner, shared by the benchmarks.

A header row of names, a row of units, then data rows; every line that is not data starts
with ``#`` so ``grep -v '^#'`` leaves numbers only. Columns are right-aligned and as wide as
their widest cell.
"""
from __future__ import annotations


def render_table(columns: list[tuple[str, str]], rows: list[list[str]]) -> list[str]:
    """Lines of a table with ``columns`` = [(name, unit)] and string cells ``rows``."""
    widths = [max(len(name), len(unit), *(len(row[i]) for row in rows)) for i, (name, unit) in enumerate(columns)]

    def line(cells, lead):
        return (lead + " ".join(c.rjust(w) for c, w in zip(cells, widths))).rstrip()

    out = [line([name for name, _ in columns], "# "), line([unit for _, unit in columns], "# ")]
    out += [line(row, "  ") for row in rows]
    return out


def fmt(value: float | None, digits: int = 2) -> str:
    """A number with ``digits`` decimals; ``n/a`` for None or NaN."""
    if value is None or value != value:
        return "n/a"
    return f"{value:.{digits}f}"
