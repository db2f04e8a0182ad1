"""The shapes world's rewards on exact renders and on edited scenes, and its prompt sources."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mogo_diffusion.prompts import load_prompt_set, shapes_prompts
from mogo_diffusion.rewards import PALETTE, MultiReward, available_rewards, make_reward
from mogo_diffusion.rewards.shapes import SHAPES_REWARDS
from mogo_diffusion.shapes import (
    COLORS,
    OBJECT_COLORS,
    Object,
    Scene,
    relations,
    render,
    render_batch,
    sample_scenes,
)

NAMES = list(SHAPES_REWARDS)


def scores(scenes, metadata=None):
    images = render_batch(scenes)
    prompts = [s.prompt for s in scenes]
    metadata = [s.metadata for s in scenes] if metadata is None else metadata
    return MultiReward([make_reward(n) for n in NAMES])(images, prompts, metadata).values


@pytest.fixture(scope="module")
def pool():
    return sample_scenes(300, 11, "train") + sample_scenes(100, 12, "heldout")


def test_exact_renders_score_full_marks_and_specialists_apply_only_to_their_prompts(pool):
    values = scores(pool)
    color, shape, position, count = values.unbind(1)
    assert torch.equal(color, torch.ones(len(pool)))
    assert torch.equal(shape, torch.ones(len(pool)))
    tags = [s.tag for s in pool]
    assert [not math.isnan(v) for v in position.tolist()] == [t == "position" for t in tags]
    assert [not math.isnan(v) for v in count.tolist()] == [t == "counting" for t in tags]
    assert bool((position[~position.isnan()] > 0.75).all())  # the relation holds on every render
    assert torch.equal(count[~count.isnan()], torch.ones(int((~count.isnan()).sum())))


def _first(pool, tag):
    return next(s for s in pool if s.tag == tag)


def test_edits_lower_exactly_the_reward_they_concern(pool):
    scene = _first(pool, "colors")  # "a <colour> <shape> on a <background> background"
    (obj,) = scene.objects
    recolored = dataclasses.replace(obj, color=next(c for c in OBJECT_COLORS if c != obj.color))
    other_shape = dataclasses.replace(obj, shape="circle" if obj.shape != "circle" else "square")
    empty_box = (1, 1, 2, 2)  # too small to be an object: the scene shows nothing
    edits = {
        "recoloured": Scene(scene.tag, scene.background, (recolored,)),
        "reshaped": Scene(scene.tag, scene.background, (other_shape,)),
        "extra object": Scene("two_object", scene.background, (obj, _far(obj, "triangle"))),
        "nothing": Scene(scene.tag, scene.background, (dataclasses.replace(obj, box=empty_box),)),
    }
    metadata = [scene.metadata] * len(edits)
    values = scores(list(edits.values()), metadata)
    by_edit = {
        name: dict(zip(NAMES, row.tolist(), strict=True)) for name, row in zip(edits, values, strict=True)
    }
    assert by_edit["recoloured"]["shapes_color"] == 0.5  # background right, object colour wrong
    assert by_edit["recoloured"]["shapes_shape"] == 1.0
    assert by_edit["reshaped"] == {**by_edit["reshaped"], "shapes_color": 1.0, "shapes_shape": 0.0}
    assert by_edit["extra object"]["shapes_shape"] == 0.5  # one matched of two detected
    assert by_edit["nothing"]["shapes_shape"] == 0.0
    assert by_edit["nothing"]["shapes_color"] == 0.5


def _far(obj: Object, shape: str) -> Object:
    """A 12 px ``shape`` in the corner farthest from ``obj``."""
    x0 = 2 if obj.box[0] > 10 else 18
    y0 = 2 if obj.box[1] > 10 else 18
    color = next(c for c in OBJECT_COLORS if c != obj.color)
    return Object(shape, color, (x0, y0, x0 + 12, y0 + 12))


def test_position_scores_the_named_relation_and_counting_the_number(pool):
    scene = _first(pool, "position")
    reference, target = scene.objects
    swapped = Scene(
        scene.tag,
        scene.background,
        (dataclasses.replace(reference, box=target.box), dataclasses.replace(target, box=reference.box)),
        scene.relation,
    )
    assert relations(swapped.objects[1].box, swapped.objects[0].box) != {scene.relation}
    counting = _first(pool, "counting")
    fewer = Scene("single_object", counting.background, counting.objects[:1])
    values = scores([scene, swapped, fewer], [scene.metadata, scene.metadata, counting.metadata])
    position, count = values[:, 2], values[:, 3]
    assert position[0] > 0.75 > position[1]
    n = counting.metadata["include"][0]["count"]
    assert count[2].item() == pytest.approx(1 - (n - 1) / n)


def test_shapes_rewards_need_the_metadata_and_are_registered():
    assert set(NAMES) <= set(available_rewards())
    image = render(sample_scenes(1)[0])[None]
    with pytest.raises(ValueError, match=r"shapes_color: sample 0 .* has no shapes metadata"):
        make_reward("shapes_color")(image, ["a red circle on a white background"], [{}])


def test_prompt_sources():
    every = load_prompt_set("shapes:train")
    assert len(every.prompts) == len(set(every.prompts))
    assert all(m["prompt"] == p for p, m in zip(every.prompts, every.metadata, strict=True))
    sampled = load_prompt_set("shapes:heldout:20")
    assert sampled == shapes_prompts("heldout", 20)
    assert sampled.prompts == [s.prompt for s in sample_scenes(20, 0, "heldout")]
    assert not set(sampled.prompts) & set(every.prompts)  # held-out captions are never trained on
    for bad in ("shapes:test", "shapes:train:x", "shapes:train:3:4", "shapes:"):
        with pytest.raises(ValueError, match="prompt source"):
            load_prompt_set(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompt_set("no/such/prompts.jsonl")


def test_the_worlds_colours_are_the_palettes():
    # scenes.COLORS repeats rules.PALETTE's values (importing it would be circular): they must agree.
    assert {name: PALETTE[name] for name in COLORS} == COLORS


def test_an_empty_batch_scores_empty():
    """D18: every reward returns an empty [0] tensor for an empty batch."""
    for name in NAMES:
        scores = make_reward(name)(torch.zeros(0, 3, 32, 32), [], [])
        assert scores.shape == (0,), name
        assert scores.dtype == torch.float32, name


def test_distinct_scenes_counts_what_the_detector_reads_and_each_kind_of_reward_is_asked_once(pool):
    """The collapse guard: k different scenes repeated read as k, whatever the repetition."""
    distinct = list(
        {(s.background, tuple(sorted((o.shape, o.color) for o in s.objects))): s for s in pool[:40]}.values()
    )
    images = render_batch([*distinct[:5], *distinct[:5], distinct[0]])
    rewards = MultiReward([make_reward(n) for n in NAMES])
    assert rewards.diagnostics(images) == {"distinct_scenes": 5.0}
    assert rewards.diagnostics(render_batch([distinct[0]] * 8)) == {"distinct_scenes": 1.0}
    assert MultiReward([make_reward("jpeg_compressibility")]).diagnostics(images) == {}


def test_the_rewards_of_one_batch_detect_it_once_and_a_changed_batch_again(pool, monkeypatch):
    from mogo_diffusion.rewards import shapes as module

    calls = []
    real = module.detect_batch
    monkeypatch.setattr(module, "detect_batch", lambda images: calls.append(len(images)) or real(images))
    scenes = pool[:6]
    images = render_batch(scenes)
    prompts, metadata = [s.prompt for s in scenes], [s.metadata for s in scenes]
    rewards = MultiReward([make_reward(n) for n in NAMES], threads=2)
    first = rewards(images, prompts, metadata).values
    rewards.diagnostics(images)
    assert calls == [6]  # four rewards and the collapse guard read one detection of the batch
    images[:, :, :, :] = images[:, :, :1, :1].clone()  # in place: every image one flat colour
    flat = rewards(images, prompts, metadata).values
    assert calls == [6, 6]
    assert (flat[:, NAMES.index("shapes_shape")] == 0).all()
    again = rewards(render_batch(scenes), prompts, metadata).values  # a new tensor
    torch.testing.assert_close(again, first, rtol=0, atol=0, equal_nan=True)
    assert calls == [6, 6, 6]


def test_the_shipped_prompt_pool_is_the_recipes_and_every_reward_applies_to_it(tmp_path):
    from mogo_diffusion.shapes.recipe import (
        EVAL_REPEATS,
        FINAL_EVAL,
        FINAL_REPEATS,
        POOL,
        POOL_COUNTS,
        pool,
        write_pool,
    )

    write_pool(tmp_path)
    shipped = ("pool.jsonl", "pool_eval.jsonl", FINAL_EVAL.name)  # the committed files are pool()'s
    for name in shipped:
        assert (tmp_path / name).read_text() == POOL.with_name(name).read_text()
    train, held_out = load_prompt_set(POOL), load_prompt_set(POOL.with_name("pool_eval.jsonl"))
    assert len(set(train.prompts)) == len(train.prompts) == sum(POOL_COUNTS.values())
    assert held_out.prompts == [p for p in train.prompts for _ in range(EVAL_REPEATS)]
    final = load_prompt_set(FINAL_EVAL)
    assert final.prompts == [p for p in train.prompts for _ in range(FINAL_REPEATS)]
    assert final.metadata == [m for m in train.metadata for _ in range(FINAL_REPEATS)]
    assert [m["tag"] for m in pool()] == [t for t, n in POOL_COUNTS.items() for _ in range(n)]
    assert set(train.prompts) <= set(load_prompt_set("shapes:train").prompts)
    images = torch.rand(len(train.prompts), 3, 32, 32, generator=torch.Generator().manual_seed(0))
    values = MultiReward([make_reward(n) for n in NAMES])(images, train.prompts, train.metadata).values
    applies = ~torch.isnan(values)
    assert applies[:, NAMES.index("shapes_position")].sum() == POOL_COUNTS["position"]
    assert applies[:, NAMES.index("shapes_count")].sum() == POOL_COUNTS["counting"]
