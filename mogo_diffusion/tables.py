"""The tables of every comparison driver (``compare``, ``study``, the benchmarks), as text.

A table is a list of rows of cells, the header first; :func:`markdown_table` and
:func:`rst_table` write one, :func:`documents` a whole results file in both forms and
:func:`write_documents` the two files ``<stem>.md`` and ``<stem>.rst``. The cells of
a comparison's numbers are written by :func:`signed` (a paired difference with its interval) and
:func:`with_difference` (a mean, then its difference); the tables every comparison has are
:func:`arms_table` (:func:`~mogo_diffusion.analysis.summarize`) and :func:`judged_tables`
(:func:`~mogo_diffusion.analysis.judge`).

>>> print(markdown_table([["arm", "r"], ["a", signed([0.05, 0.01, 0.09])]]))
| arm | r |
|---|---|
| a | +0.050 [+0.010, +0.090] |
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "Table",
    "arms_table",
    "documents",
    "judged_tables",
    "markdown_table",
    "rst_table",
    "signed",
    "with_difference",
    "write_documents",
]

Table = tuple[str, list[list[str]]]
"""A caption and the rows of cells (the header row first)."""


def markdown_table(rows: Sequence[Sequence[str]], *, numeric: bool = False) -> str:
    """``rows`` (header first) as a markdown table, without a trailing newline; ``numeric``: every
    column but the first right-aligned."""
    header, *body = rows
    rule = "|---|" + ("---:|" if numeric else "---|") * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", rule]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def rst_table(rows: Sequence[Sequence[str]], caption: str = "") -> str:
    """``rows`` (header first) as a reStructuredText list-table, without a trailing newline; an
    empty cell is written as a space so that the list keeps its shape."""
    lines = [".. list-table::" + (f" {caption}" if caption else ""), "   :header-rows: 1", ""]
    for row in rows:
        lines += [f"   * - {row[0]}", *(f"     - {cell or ' '}" for cell in row[1:])]
    return "\n".join(lines)


def documents(
    command: str | None, notes: Sequence[str], sections: Mapping[str | None, Sequence[Table]]
) -> tuple[str, str]:
    """A results file as markdown and as reStructuredText (for the docs): the command that made
    it, ``notes`` (a paragraph each), then per section (its title; None: untitled) its tables,
    each under its caption (none when empty)."""
    lines = [
        *([f"Command: `{command}`", ""] if command else []),
        *(line for note in notes for line in (note, "")),
    ]
    blocks = [*([f"Command: ``{command}``"] if command else []), *notes]
    for title, tables in sections.items():
        if title is not None:
            lines += [f"## {title}", ""]
            blocks.append(f"**{title}**")
        for caption, rows in tables:
            lines += [*([caption, ""] if caption else []), markdown_table(rows), ""]
            blocks.append(rst_table(rows, caption))
    return "\n".join(lines), "\n\n".join(blocks) + "\n"


def write_documents(
    out: Path,
    stem: str,
    command: str | None,
    notes: Sequence[str],
    sections: Mapping[str | None, Sequence[Table]],
) -> str:
    """Write :func:`documents`' two forms to ``out/<stem>.md`` and ``out/<stem>.rst``; returns the
    markdown."""
    markdown, rst = documents(command, notes, sections)
    (out / f"{stem}.md").write_text(markdown)
    (out / f"{stem}.rst").write_text(rst)
    return markdown


def signed(interval: Sequence[float], digits: int = 3) -> str:
    """``[mean, low, high]`` as ``+m [+l, +h]``; ``n/a`` for a NaN mean."""
    mean, low, high = interval
    if math.isnan(mean):
        return "n/a"
    return f"{mean:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"


def with_difference(mean: float, difference: Sequence[float], form: str = ".3f") -> str:
    """A mean (``format(mean, form)``) and, in brackets, its paired difference (:func:`signed`)."""
    return f"{mean:{form}} ({signed(difference)})"


def arms_table(summary: Mapping[str, Any], reference: str) -> Table:
    """Every arm's held-out means of :func:`~mogo_diffusion.analysis.summarize`'s ``summary``, each
    with its difference to ``reference`` paired by seed, and the composite; the pretrained model
    first."""
    names = summary["rewards"]
    rows = [["arm", *names, "composite"], ["base", *(f"{v:.3f}" for v in summary["base"]), ""]]
    for arm, row in summary["arms"].items():
        cells = [with_difference(statistics.fmean(row["means"][n]), row["vs_reference"][n]) for n in names]
        composite = with_difference(
            statistics.fmean(row["composite"]), row["vs_reference"]["composite"], "+.2f"
        )
        rows.append([arm, *cells, composite])
    caption = (
        f"Seeds {summary['seeds']}: the mean over seeds, then the mean difference to {reference} "
        "paired by seed with its 95 % bootstrap interval."
    )
    return caption, rows


_JUDGED = (
    ("mean_gain", "mean gain", ".3f"),
    ("worst_gain", "worst gain", ".3f"),
    ("hypervolume", "hypervolume", ".4f"),
    ("beyond_front", "beyond the front", ".4f"),
    ("composite", "composite", "+.2f"),
)
"""The columns of :func:`judged_tables`' first table: the key of a judged quantity, its header and
the format of its mean."""


def judged_tables(judged: Mapping[str, Any], reference: str) -> list[Table]:
    """:func:`~mogo_diffusion.analysis.judge`'s ``judged`` as two tables: per arm the mean and
    worst normalised gain, the hypervolume, what it adds beyond the weighted-sum front, the
    composite, and how often the front dominates it; and per arm and reward its normalised gain.
    Each number is the mean over seeds, then its difference to ``reference`` paired by seed."""
    names, arms = judged["rewards"], judged["arms"]
    units = ", ".join(
        f"{name} in units of its specialist's gain ({scale:.3f})" if normalised else f"{name} raw"
        for name, scale, normalised in zip(names, judged["scales"], judged["normalised"], strict=True)
    )
    summary = [["arm", *(header for _, header, _ in _JUDGED), "dominated by the front (seeds)"]]
    for arm, row in arms.items():
        summary.append([arm, *(_judged_cell(row[key], form) for key, _, form in _JUDGED), _dominance(row)])
    gains = [
        ["arm", *names],
        *([arm, *(_judged_cell(row[f"gain/{n}"]) for n in names)] for arm, row in arms.items()),
    ]
    front = ", ".join(judged["front"])
    return [
        (
            f"Gains over the pretrained model ({units}): their mean and worst over the rewards, the "
            f"hypervolume of the arm's point over the pretrained model's, what it adds to the front's "
            f"({front}), each the mean over seeds, then the difference to {reference} paired by "
            "seed with its 95 % bootstrap interval; the share of seeds at which a front point "
            "dominates the arm's, with its interval.",
            summary,
        ),
        (
            f"Each reward's gain over the pretrained model ({units}), then its difference to {reference}.",
            gains,
        ),
    ]


def _judged_cell(quantity: Mapping[str, Any], form: str = ".3f") -> str:
    """A judged quantity's mean over seeds and its paired difference to the reference."""
    return with_difference(quantity["mean"], quantity["vs_reference"], form)


def _dominance(row: Mapping[str, Any]) -> str:
    """The share of seeds at which the front dominates an arm, its interval, and by which points."""
    share, low, high = row["dominated"]
    by = "; ".join(f"{arm} at {', '.join(map(str, seeds))}" for arm, seeds in row["dominated_by"].items())
    return f"{share:.2f} [{low:.2f}, {high:.2f}]" + (f": {by}" if by else "")
