"""Factories by name: mogo.Registry, the weightings registered in it, and the one "did you mean"."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mogo
from mogo.registry import closest

ROOT = Path(__file__).resolve().parent.parent


def test_make_weighting_builds_the_registered_class_with_its_options():
    weighting = mogo.make_weighting("weighted_sum", weights=[1.0, 3.0])
    assert isinstance(weighting, mogo.WeightedSum)
    weights = weighting(torch.eye(2, dtype=torch.float64), torch.ones(2))
    assert torch.equal(weights.loss_weights, torch.tensor([1.0, 3.0], dtype=torch.float64))


def test_an_unknown_name_suggests_the_closest_and_lists_the_known_ones():
    with pytest.raises(
        ValueError, match=r"unknown weighting 'min_nrom' \(did you mean 'min_norm'\?\)"
    ) as error:
        mogo.make_weighting("min_nrom")
    assert f"Known weightings: {', '.join(sorted(mogo.WEIGHTINGS))}" in str(error.value)


def test_a_rejected_option_names_the_weighting():
    with pytest.raises(ValueError, match=r"weighting 'min_norm': .*unexpected keyword argument 'bogus'"):
        mogo.make_weighting("min_norm", bogus=1)


def test_register_weighting_adds_a_name_and_refuses_a_taken_or_malformed_one():
    mogo.register_weighting("my_sum", mogo.WeightedSum)
    try:
        assert isinstance(mogo.make_weighting("my_sum", weights=[1.0]), mogo.WeightedSum)
        assert mogo.WEIGHTINGS["my_sum"] is mogo.WeightedSum
        with pytest.raises(ValueError, match="'my_sum' is already registered"):
            mogo.register_weighting("my_sum", mogo.WeightedSum)
        with pytest.raises(ValueError, match="lower-case letters, digits and '_'"):
            mogo.register_weighting("My-Sum", mogo.WeightedSum)
    finally:
        mogo.WEIGHTINGS.pop("my_sum")
    assert "my_sum" not in mogo.WEIGHTINGS


class Mean(mogo.CheckedWeighting):
    """A weighting of one's own on mogo's base: the mean of the gradients, whatever G."""

    def weigh(self, gram: mogo.CheckedGram, losses: torch.Tensor) -> mogo.Weights:
        K = gram.host.shape[0]
        return mogo.Weights.from_combination(torch.full((K,), 1.0 / K, dtype=torch.float64))


def test_a_registered_weighting_on_mogos_base_checks_g_and_its_weights():
    mogo.register_weighting("mean", Mean)
    try:
        weighting = mogo.make_weighting("mean")
    finally:
        mogo.WEIGHTINGS.pop("mean")
    weights = weighting(torch.eye(4, dtype=torch.float64), torch.ones(4)).loss_weights
    assert torch.equal(weights, torch.full((4,), 0.25, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"G contains NaN or Inf: entry \(0, 1\) is nan"):
        weighting(torch.tensor([[1.0, float("nan")], [float("nan"), 1.0]]), torch.ones(2))
    with pytest.raises(TypeError, match=r"abstract method '?weigh"):  # the one method to write
        type("Incomplete", (mogo.CheckedWeighting,), {})()


# ---- mogo.Registry ---------------------------------------------------------------------------


def test_register_works_as_a_call_and_as_a_decorator_and_returns_the_factory():
    shapes = mogo.Registry("shape", {"square": lambda side=1.0: side**2})

    @shapes.register("circle")
    def circle(radius: float = 1.0) -> float:
        return 3.0 * radius**2

    assert circle(2.0) == 12.0  # the decorator hands the function back unchanged
    assert shapes.register("line", len) is len
    assert list(shapes) == ["square", "circle", "line"]  # a mapping, in the order of registration
    assert shapes.names() == ("circle", "line", "square")
    assert len(shapes) == 3
    assert shapes["circle"] is circle
    assert "cube" not in shapes
    assert shapes.make("square", side=3.0) == 9.0
    assert shapes.factory("line") is len


def test_a_taken_name_is_refused_when_the_decorator_is_applied_and_a_bad_one_at_once():
    shapes = mogo.Registry("shape", {"square": lambda: 1.0})
    decorate = shapes.register("square")  # the name is well formed: no error yet
    with pytest.raises(ValueError, match=r"shape 'square' is already registered \(by <function"):
        decorate(lambda: 2.0)
    assert shapes.make("square") == 1.0  # the first registration stands
    for bad in ("", "Square", "two words", "3d", None, 7):
        with pytest.raises(
            ValueError, match=rf"a shape name must be a non-empty string .* got {re.escape(repr(bad))}"
        ):
            shapes.register(bad)


def test_lookups_name_the_kind_the_closest_name_and_the_known_ones():
    shapes = mogo.Registry("shape", {"square": lambda: 1.0, "circle": lambda: 2.0})
    for lookup in (shapes.factory, shapes.make, shapes.pop):
        with pytest.raises(
            ValueError,
            match=r"^unknown shape 'cirle' \(did you mean 'circle'\?\)\. Known shapes: circle, square$",
        ):
            lookup("cirle")
    with pytest.raises(ValueError, match=r"^unknown shape 'zzz'\. Known shapes: circle, square$"):
        shapes.factory("zzz")
    with pytest.raises(KeyError):  # as a mapping, a missing key is a KeyError
        shapes["zzz"]


def test_make_passes_on_what_the_factory_raises():
    shapes = mogo.Registry("shape", {"square": lambda side=1.0: side**2})
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'sides'$"):
        shapes.make("square", sides=2)


def test_a_copy_registers_apart_and_pop_removes():
    shapes = mogo.Registry("shape", {"square": lambda: 1.0})
    scratch = shapes.copy()
    scratch.register("circle", lambda: 2.0)
    assert scratch.names() == ("circle", "square")
    assert shapes.names() == ("square",)
    assert scratch.pop("circle")() == 2.0
    assert scratch.names() == ("square",)


def test_rewards_and_weightings_are_one_registry_design():
    from mogo_diffusion.rewards import registry as rewards

    assert isinstance(rewards.REWARDS, mogo.Registry)
    assert isinstance(mogo.WEIGHTINGS, mogo.Registry)
    assert rewards.available_rewards() == rewards.REWARDS.names()


# ---- the one "did you mean" ------------------------------------------------------------------


NAMES = st.lists(st.text("abcdefghij_", min_size=1, max_size=12), min_size=1, max_size=8, unique=True)


@given(NAMES, st.data())
def test_a_known_word_is_its_own_closest(choices, data):
    word = data.draw(st.sampled_from(choices))
    assert closest(word, choices) == f" (did you mean {word!r}?)"


@given(st.text(max_size=12), st.lists(st.text(max_size=12), max_size=8))
def test_the_hint_is_empty_or_names_one_of_the_choices(word, choices):
    hint = closest(word, choices)
    assert hint == "" or any(hint == f" (did you mean {choice!r}?)" for choice in choices)
    assert closest(word, []) == ""


def test_a_word_that_is_no_string_is_compared_as_its_text():
    assert closest(12, ["13", "120", "seed"]) == " (did you mean '120'?)"
    assert closest("zzz", ["lr", "seed"]) == ""


def test_difflib_is_used_by_closest_alone():
    """Every "did you mean" of mogo and mogo_diffusion is mogo.registry.closest."""
    users = [
        path.relative_to(ROOT).as_posix()
        for package in ("mogo", "mogo_diffusion")
        for path in sorted((ROOT / package).rglob("*.py"))
        if re.search(r"\bdifflib\b", path.read_text())
    ]
    assert users == ["mogo/registry.py"]
