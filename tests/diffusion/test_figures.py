"""The figures and tables every comparison driver shares, read through their plotted data and cells."""

from __future__ import annotations

import statistics

import pytest

from mogo_diffusion import figures, tables
from mogo_diffusion.analysis import judge, summarize

NAMES = ("r1", "r2", "r3")
BASE = [0.2, 0.4, 0.1]


def judged_comparison() -> dict:
    """Three rewards, two seeds, a front of two weighted sums and one other arm."""
    points = {
        "single:r1": [0.6, 0.3, 0.1],
        "weighted_sum": [0.4, 0.5, 0.2],
        "weighted_sum@2,1,1": [0.5, 0.45, 0.15],
        "marble": [0.35, 0.55, 0.3],
    }
    means = {arm: {s: [v + 0.01 * s for v in point] for s in (0, 1)} for arm, point in points.items()}
    return judge(summarize(NAMES, BASE, means, "weighted_sum"), reference="weighted_sum",
                 front=["weighted_sum", "weighted_sum@2,1,1"])  # fmt: skip


def offsets(axis, label: str) -> list[list[float]]:
    (collection,) = [c for c in axis.collections if c.get_label() == label]
    return collection.get_offsets().tolist()


def test_the_front_places_every_arm_at_its_mean_gains_in_one_panel_per_pair_of_rewards():
    judged = judged_comparison()
    figure = figures.front(judged)
    panels = [axis for axis in figure.axes if axis.get_visible()]
    assert len(panels) == 3  # (r1, r2), (r1, r3), (r2, r3)
    pairs = [(0, 1), (0, 2), (1, 2)]
    for axis, (i, j) in zip(panels, pairs, strict=True):
        assert axis.get_xlabel() == f"{NAMES[i]} gain"
        assert axis.get_ylabel() == f"{NAMES[j]} gain"
        assert offsets(axis, "pretrained") == [[0.0, 0.0]]
        for arm, row in judged["arms"].items():
            expected = [row[f"gain/{NAMES[i]}"]["mean"], row[f"gain/{NAMES[j]}"]["mean"]]
            assert offsets(axis, arm) == [pytest.approx(expected, abs=1e-12)]
    # r1's unit is its specialist's gain: 0.6 + 0.005 (mean over seeds) - 0.2; the others are raw
    assert offsets(panels[0], "single:r1")[0][0] == pytest.approx(1.0)
    assert offsets(panels[2], "marble")[0] == pytest.approx([0.155, 0.205])
    colours = {arm: tuple(c.get_facecolor()[0]) for arm in judged["arms"] for c in panels[0].collections
               if c.get_label() == arm}  # fmt: skip
    assert colours["weighted_sum"] == colours["weighted_sum@2,1,1"] != colours["marble"]  # the front in gray


def test_one_reward_has_one_panel_of_its_gain_per_arm():
    means = {"weighted_sum": {0: [0.5]}, "marble": {0: [0.7]}}
    judged = judge(
        summarize(["r"], [0.4], means, "weighted_sum"), reference="weighted_sum", front=["weighted_sum"]
    )
    (axis,) = figures.front(judged).axes
    assert offsets(axis, "marble") == [[pytest.approx(0.3), 1.0]]  # the raw gain, the arm's row


def test_intervals_draw_each_arm_with_its_bounds():
    panels = {"composite": {"a": [0.1, -0.2, 0.3], "b": [0.0, 0.0, 0.0]}, "other": {"a": [1.0, 0.5, 2.0]}}
    figure = figures.intervals(panels, "minus the reference's")
    first, second = figure.axes
    (container,) = first.containers
    line, _, (bars,) = container
    assert line.get_xdata().tolist() == [0.1, 0.0]
    assert line.get_ydata().tolist() == [0, 1]
    segments = [segment[:, 0].tolist() for segment in bars.get_segments()]
    assert segments == [pytest.approx([-0.2, 0.3]), [0.0, 0.0]]
    assert [label.get_text() for label in first.get_yticklabels()] == ["a", "b"]
    assert second.get_title() == "other"


HISTORY = [
    {"epoch": 0, "seconds": 30.0, "images_per_second": 4.0},
    {"epoch": 1, "seconds": 42.0, "images_per_second": 3.0, "eval/r1": 0.7},
    {"epoch": 2, "seconds": 18.0, "images_per_second": 7.0},
    {"epoch": 3, "seconds": 30.0, "images_per_second": 4.0, "eval/r1": 0.9},
]


def test_a_learning_curve_starts_at_the_pretrained_model_and_sums_images_and_seconds():
    assert figures.learning_curve(HISTORY, "eval/r1", 0.5) == [
        {"images": 0.0, "minutes": 0.0, "value": 0.5},
        {"images": 246.0, "minutes": 1.2, "value": 0.7},  # 120 + 126 images, 72 s
        {"images": 492.0, "minutes": 2.0, "value": 0.9},
    ]
    assert figures.learning_curve(HISTORY, "eval/r2", 0.5) == []  # a reward this run never evaluated


def test_curves_average_the_seeds_against_images_and_minutes():
    other = [
        {**record, "eval/r1": record["eval/r1"] - 0.2} if "eval/r1" in record else record
        for record in HISTORY
    ]
    figure = figures.curves(["r1"], {"eval/r1": 0.5}, {"marble": {"r1": [HISTORY, other]}}, "title")
    top, bottom = figure.axes
    (mean,) = [line for line in top.get_lines() if line.get_label() == "marble"]
    assert mean.get_xdata().tolist() == [0.0, 246.0, 492.0]
    assert mean.get_ydata().tolist() == pytest.approx([0.5, 0.6, 0.8])
    seeds = [line for line in top.get_lines() if line.get_label().startswith("_marble seed")]
    assert [line.get_ydata().tolist() for line in seeds] == [[0.5, 0.7, 0.9], pytest.approx([0.5, 0.5, 0.7])]
    (minutes,) = [line for line in bottom.get_lines() if line.get_label() == "marble"]
    assert minutes.get_xdata().tolist() == pytest.approx([0.0, 1.2, 2.0])
    (pretrained,) = [line for line in top.get_lines() if line.get_label() == "pretrained"]
    assert list(pretrained.get_ydata()) == [0.5, 0.5]


def test_alphas_and_a_runs_curves_draw_each_metric():
    records = [{"epoch": e, "alpha/r1": 0.1 * e, "alpha/r2": 1 - 0.1 * e, "reward/r1": e,
                "conflict_rate": 0.5} for e in range(3)]  # fmt: skip
    figure = figures.alphas({"marble": records, "weighted_sum": [{"epoch": 0}]}, ["r1", "r2"])
    (axis,) = figure.axes  # the weighted sum logs no weights
    lines = {line.get_label(): line.get_ydata().tolist() for line in axis.get_lines()}
    assert lines == {"r1": pytest.approx([0.0, 0.1, 0.2]), "r2": pytest.approx([1.0, 0.9, 0.8])}
    assert figures.alphas({"weighted_sum": [{"epoch": 0}]}, ["r1"]) is None
    panels = figures.run_curves(records).axes
    assert [axis.get_title() for axis in panels] == [
        "training reward (mean of the epoch's samples)",
        "alpha (MARBLE weights)",
        "conflict rate of the weighted sum",
    ]
    assert {line.get_label() for line in panels[1].get_lines()} == {"r1", "r2"}


def test_save_writes_a_palette_png(tmp_path):
    from PIL import Image

    figure = figures.intervals({"t": {"a": [0.1, 0.0, 0.2]}}, "x")
    with Image.open(figures.save(figure, tmp_path / "f.png")) as image:
        assert image.mode == "P"
        assert image.size == (520, 420)  # 5.2 x 4.2 inches at 100 dots per inch


def test_the_tables_of_a_judgement_hold_each_arms_numbers():
    judged = judged_comparison()
    (caption, summary), (_, gains) = tables.judged_tables(judged, "weighted_sum")
    assert summary[0] == ["arm", "mean gain", "worst gain", "hypervolume", "beyond the front", "composite",
                          "dominated by the front (seeds)"]  # fmt: skip
    rows = {row[0]: row for row in summary[1:]}
    marble = judged["arms"]["marble"]
    assert rows["marble"][1] == tables.with_difference(
        marble["mean_gain"]["mean"], marble["mean_gain"]["vs_reference"]
    )
    assert rows["weighted_sum"][2].endswith("(+0.000 [+0.000, +0.000])")
    assert rows["marble"][6] == "0.00 [0.00, 0.00]"  # r3 better than both front points: never dominated
    assert "r1 in units of its specialist's gain (0.405)" in caption
    assert "r2 raw" in caption
    assert gains[0] == ["arm", *NAMES]
    assert marble["gain/r2"]["mean"] == pytest.approx(statistics.fmean([0.55 - 0.4, 0.56 - 0.4]))  # raw
    assert gains[-1][2].startswith("0.155 (")


def test_documents_write_the_same_tables_as_markdown_and_rst():
    rows = [["arm", "r"], ["a", "1"], ["b", ""]]
    markdown, rst = tables.documents(
        "cmd --x", ["A note."], {"set": [("Caption.", rows)], None: [("", rows)]}
    )
    assert markdown.splitlines()[:6] == ["Command: `cmd --x`", "", "A note.", "", "## set", ""]
    assert markdown.count("| a | 1 |") == 2
    assert rst.startswith("Command: ``cmd --x``\n\nA note.\n\n**set**\n\n.. list-table:: Caption.")
    assert "     -  \n" in rst  # an empty cell is a space: the list keeps its shape
    assert tables.signed([float("nan")] * 3) == "n/a"
