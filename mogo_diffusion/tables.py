"""Tables as text: one list of rows (the first the header) as markdown or an RST list-table."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["markdown_table", "rst_table"]


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    """``rows`` (header first) as a markdown table, without a trailing newline."""
    header, *body = rows
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def rst_table(rows: Sequence[Sequence[str]], caption: str = "") -> str:
    """``rows`` (header first) as a reStructuredText list-table, without a trailing newline; an
    empty cell is written as a space so that the list keeps its shape."""
    lines = [".. list-table::" + (f" {caption}" if caption else ""), "   :header-rows: 1", ""]
    for row in rows:
        lines += [f"   * - {row[0]}", *(f"     - {cell or ' '}" for cell in row[1:])]
    return "\n".join(lines)
