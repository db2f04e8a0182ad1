"""Mixed prompt pools: per-epoch proportions, metadata that make the specialists NaN exactly outside
their own prompts (scored by the real OCR and GenEval rewards), config and trainer wiring."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mogo_diffusion.config import Config, ConfigError, PromptSource, load_config
from mogo_diffusion.prompts import PromptPool, PromptSet, load_prompt_pool, load_prompt_set, ocr_prompts
from mogo_diffusion.rewards import MultiReward, make_reward
from mogo_diffusion.rewards.geneval import GenEvalReward
from tests.diffusion.test_ocr_geneval import BoxFinder, two_boxes_image


def sets(sizes):
    return [PromptSet([f"p{j}-{i}" for i in range(n)], [{} for _ in range(n)]) for j, n in enumerate(sizes)]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(1e-3, 1e3), min_size=1, max_size=6),
    st.integers(0, 200),
    st.integers(0, 2**32),
)
def test_counts_are_the_floor_or_ceil_of_each_quota_and_sum_to_n(weights, n, seed):
    pool = PromptPool(sets([3] * len(weights)), weights)
    counts = pool.counts(n, torch.Generator().manual_seed(seed))
    total = sum(Fraction(w) for w in weights)
    assert sum(counts) == n
    for count, w in zip(counts, weights, strict=True):
        quota = n * Fraction(w) / total
        assert math.floor(quota) <= count <= math.ceil(quota)


def test_counts_honour_the_weights_in_expectation():
    """48 prompts at 0.4 / 0.4 / 0.2: quotas 19.2, 19.2, 9.6. Each count is floor + Bernoulli(frac), so
    the mean of D draws has standard deviation sqrt(f (1 - f) / D) <= 0.5 / sqrt(D): 5 of those bound it."""
    pool = PromptPool(sets([5, 5, 5]), [0.4, 0.4, 0.2])
    draws = 4000
    generator = torch.Generator().manual_seed(0)
    mean = torch.tensor([pool.counts(48, generator) for _ in range(draws)], dtype=torch.float64).mean(0)
    quotas = torch.tensor([48 * 0.4, 48 * 0.4, 48 * 0.2], dtype=torch.float64)
    assert torch.allclose(mean, quotas, rtol=0, atol=5 * 0.5 / draws**0.5)


def test_exact_quotas_are_met_every_epoch_without_randomness():
    pool = PromptPool(sets([4, 7, 2]), [1, 1, 1])
    generator = torch.Generator().manual_seed(3)
    state = generator.get_state()
    assert pool.counts(48, generator) == [16, 16, 16]
    assert torch.equal(generator.get_state(), state)  # nothing drawn


def test_draw_takes_each_sources_count_from_that_source_in_random_order():
    pool = PromptPool(sets([4, 7, 2]), [2, 1, 1])
    rows = pool.draw(40, torch.Generator().manual_seed(5))
    source = [int(pool.prompts[i][1]) for i in rows.tolist()]
    assert [source.count(j) for j in range(3)] == [20, 10, 10]
    assert source != sorted(source)  # shuffled: groups of one source do not all land on one process
    assert rows.dtype == torch.int64
    assert pool.draw(40, torch.Generator().manual_seed(5)).tolist() == rows.tolist()  # deterministic


@given(st.integers(1, 30), st.integers(0, 100), st.integers(0, 2**32))
def test_a_pool_of_one_draws_exactly_what_the_trainer_drew_before_pools(size, n, seed):
    """So runs with a single prompt source reproduce their earlier prompts and noise."""
    (one,) = sets([size])
    a, b = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    assert torch.equal(PromptPool([one], [1.0]).draw(n, a), torch.randint(size, (n,), generator=b))
    assert torch.equal(a.get_state(), b.get_state())


@pytest.mark.parametrize(
    ("sets_", "weights", "match"),
    [
        ([], [], "a source"),
        (sets([2]), [1, 2], "one weight"),
        (sets([2, 0]), [1, 1], "source 1 has no prompts"),
        (sets([2]), [0], "positive finite"),
        (sets([2]), [math.inf], "positive finite"),
        (sets([2]), [True], "positive finite"),
    ],
)
def test_bad_pools(sets_, weights, match):
    with pytest.raises(ValueError, match=match):
        PromptPool(sets_, weights)


@pytest.fixture
def files(tmp_path):
    ocr = tmp_path / "ocr.txt"
    ocr.write_text('a sign that says "open"\na mug with the text "tea"\n')
    general = tmp_path / "general.txt"  # a quoted word, but not an OCR prompt
    general.write_text('a cat on a sofa\nan old man saying "hello"\n')
    geneval = tmp_path / "geneval.jsonl"
    meta = {"tag": "color_attr", "include": [{"class": "car", "count": 1, "color": "red"},
                                             {"class": "bench", "count": 1, "color": "blue"}]}  # fmt: skip
    geneval.write_text(json.dumps({**meta, "prompt": "a photo of a red car and a blue bench"}) + "\n")
    return ocr, general, geneval


def test_the_real_specialists_are_nan_exactly_outside_their_own_prompts(files):
    ocr_file, general_file, geneval_file = files
    pool = load_prompt_pool(
        [
            PromptSource(str(ocr_file), 0.4, "ocr"),
            PromptSource(str(geneval_file), 0.4),  # inferred: geneval
            PromptSource(str(general_file), 0.2),  # inferred: general
        ]
    )
    assert pool.rewards == ["ocr", "geneval", "general"]
    sources = [m["source"] for m in pool.metadata]
    assert sources == [str(ocr_file)] * 2 + [str(geneval_file)] + [str(general_file)] * 2
    # Plain prompts score OCR on the quoted "hello"; in the pool it is not an OCR prompt.
    assert load_prompt_set(general_file).metadata[1] == {}
    images = torch.ones(len(pool.prompts), 3, 64, 64)
    images[2] = two_boxes_image()  # a red car left, a blue bench right: what the GenEval prompt asks
    rewards = MultiReward([make_reward("ocr"), GenEvalReward(BoxFinder()), make_reward("sharpness")])
    scores = rewards(images, pool.prompts, pool.metadata).values
    plain = rewards(images[3:], pool.prompts[3:], [{}, {}]).values
    assert not plain[1, 0].isnan()  # what the pool's marking prevents
    is_ocr = torch.tensor([s == str(ocr_file) for s in sources])
    is_geneval = torch.tensor([s == str(geneval_file) for s in sources])
    assert torch.equal(scores[:, 0].isnan(), ~is_ocr)
    assert torch.equal(scores[:, 1].isnan(), ~is_geneval)
    assert not scores[:, 2].isnan().any()  # a general reward scores every prompt
    assert scores[2, 1] == 1.0  # the red car and blue bench BoxFinder finds, scored by its metadata


def test_marking_errors_name_the_entry_and_the_prompt(files):
    ocr_file, general_file, geneval_file = files
    with pytest.raises(
        ValueError, match=r"entry 1 \('.*general.txt'\): prompt 1 \('a cat on a sofa'\) has no text"
    ):
        load_prompt_pool([PromptSource(str(ocr_file)), PromptSource(str(general_file), reward="ocr")])
    with pytest.raises(ValueError, match=r"entry 0 .*prompt 1 .* carries GenEval metadata, but .* 'general'"):
        load_prompt_pool([PromptSource(str(geneval_file), reward="general")])
    with pytest.raises(ValueError, match=r"entry 0 .*prompt 1 .*not a GenEval prompt"):
        load_prompt_pool([PromptSource(str(general_file), reward="geneval")])
    with pytest.raises(
        FileNotFoundError, match=r"entry 1 \('nope.txt'\): prompt file 'nope.txt' does not exist"
    ):
        load_prompt_pool([PromptSource(str(ocr_file)), PromptSource("nope.txt")])
    with pytest.raises(ValueError, match="at least one source"):
        load_prompt_pool([])


def test_generated_sources_and_inference():
    pool = load_prompt_pool(
        [PromptSource("ocr:3"), PromptSource("geneval:2"), PromptSource("shapes:train:2")]
    )
    assert pool.rewards == ["ocr", "geneval", "geneval"]
    assert [m["text"] for m in pool.metadata[:3]] == [m["text"] for m in ocr_prompts(3).metadata]
    assert all(m["text"] is None for m in pool.metadata[3:])
    for bad in ("ocr:", "ocr:0", "geneval:x"):
        with pytest.raises(ValueError, match="positive integer"):
            load_prompt_set(bad)


def test_a_single_source_keeps_its_metadata_as_loaded(files):
    pool = load_prompt_pool(str(files[1]))
    assert pool.metadata == [{}, {}]
    assert pool.rewards == [None]


def test_config_round_trip_overrides_and_errors(tmp_path):
    text = """
rewards: [{name: ocr}]
sampling:
  prompts:
    - {source: ocr.txt, weight: 0.4, reward: ocr}
    - {source: geneval.jsonl, weight: 0.4}
    - {source: pickapic.txt, weight: 0.2}
"""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    config = load_config(path, ["sampling.prompts.2.weight=0.3"])
    assert config.sampling.prompts == [
        PromptSource("ocr.txt", 0.4, "ocr"),
        PromptSource("geneval.jsonl", 0.4),
        PromptSource("pickapic.txt", 0.3),
    ]
    saved = tmp_path / "saved.yaml"
    config.save(saved)
    assert load_config(saved) == config == Config.from_dict(config.to_dict())
    assert load_config(saved, ["sampling.prompts=shapes:train"]).sampling.prompts == "shapes:train"
    for override, message in [
        ("sampling.prompts=[]", "sampling.prompts: must be non-empty, got []"),
        ("sampling.prompts.1.weight=0", "sampling.prompts.1.weight: must be > 0, got 0.0"),
        ("sampling.prompts.1.weight=-1", "sampling.prompts.1.weight: must be > 0, got -1.0"),
        ("sampling.prompts.1.source=ocr.txt", "sampling.prompts.1.source: 'ocr.txt' is already"),
        ("sampling.prompts.3={weight: 1}", "sampling.prompts.3.source: required"),
        ("sampling.prompts.0.reward=OCR", "sampling.prompts.0.reward: must be one of 'ocr', 'geneval'"),
        ("sampling.prompts.0.wieght=1", "sampling.prompts.0.wieght: unknown key (did you mean 'weight'?)"),
        ("sampling.prompts=3", "sampling.prompts: expected a string or a list, got int 3"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError) as error:
            load_config(path, [override])
        assert str(error.value).startswith(message)


def test_the_trainer_draws_each_epoch_from_the_pool(tmp_path, tiny_dir):
    from mogo_diffusion.train import Trainer

    tiny = tiny_dir
    config = Config.from_dict(
        {
            "model": {"pretrained": str(tiny), "dtype": "float32", "lora_rank": 2, "lora_alpha": 4,
                      "max_sequence_length": 16},
            "sampling": {"num_steps": 1, "resolution": 32, "group_size": 2, "prompts_per_epoch": 6,
                         "batch_size": 12, "solver": "euler", "eval_prompts": None,
                         "prompts": [{"source": "ocr:4", "weight": 2}, {"source": "geneval:4", "weight": 1}]},
            "rewards": [{"name": "sharpness"}],
            "train": {"mixed_precision": "no", "out_dir": str(tmp_path / "run")},
        }
    )  # fmt: skip
    trainer = Trainer.from_config(config)
    batch = trainer.sample(0)
    expected = trainer.prompts.draw(6, trainer.stream("sampling", 0))
    assert batch.prompts == [trainer.prompts.prompts[i] for i in expected.tolist() for _ in range(2)]
    sources = [m["source"] for m in batch.metadata]
    assert (sources.count("ocr:4"), sources.count("geneval:4")) == (8, 4)
    with pytest.raises(ConfigError, match=r"sampling.prompts: entry 1 \('missing.txt'\): prompt file"):
        Trainer.from_config(load_config(None, ["rewards.0.name=sharpness", f"model.pretrained={tiny}",
                                   "sampling.resolution=32",
                                   "sampling.prompts=[{source: ocr:2}, {source: missing.txt}]"]))  # fmt: skip
