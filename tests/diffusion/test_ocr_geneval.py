"""The OCR and GenEval rewards and the prompt sets: real OCR, GenEval's rules, a tiny real detector."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image, ImageDraw, ImageFont

from mogo_diffusion.prompts import (
    OCR_TEMPLATES,
    geneval_prompts,
    load_geneval_metadata,
    load_prompt_set,
    load_prompts,
    ocr_prompts,
)
from mogo_diffusion.rewards import Reward, available_rewards, make_reward
from mogo_diffusion.rewards.geneval import (
    GENEVAL_CLASSES,
    GENEVAL_COLORS,
    GENEVAL_TAGS,
    MAX_OBJECTS,
    Detection,
    GenEvalReward,
    HsvColorClassifier,
    TransformersDetector,
    box_iou,
    check_metadata,
    evaluate,
    relative_position,
    select_objects,
)
from mogo_diffusion.rewards.ocr import (
    OcrReward,
    _rapidocr_options,
    levenshtein,
    normalize_text,
    ocr_score,
    quoted_text,
)

# OCR: the text rules -----------------------------------------------------------------------------


def test_levenshtein():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == levenshtein("abc", "") == 3
    assert levenshtein("flaw", "lawn") == 2
    assert levenshtein("same", "same") == 0


@given(st.text("abc ", max_size=8), st.text("abc ", max_size=8), st.text("abc ", max_size=8))
def test_levenshtein_is_a_metric(a, b, c):
    d = levenshtein(a, b)
    assert d == levenshtein(b, a)
    assert (d == 0) == (a == b)
    assert abs(len(a) - len(b)) <= d <= max(len(a), len(b))
    assert levenshtein(a, c) <= d + levenshtein(b, c)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ('a sign that says "hello"', "hello"),
        ('two quotes: "first" and "second"', "first"),
        ("typographic “Open Late” quotes", "Open Late"),
        ('“curly” before "straight"', "curly"),
        ('an unclosed "quote to the end', "quote to the end"),  # as Flow-GRPO's split('"')[1]
        ('empty "" quotes', ""),
        ("a dog's 'sign'", None),  # single quotes are apostrophes, not quotes
        ("no quotes at all", None),
    ],
)
def test_quoted_text(prompt, expected):
    assert quoted_text(prompt) == expected


def test_ocr_score_rules():
    assert normalize_text(" Open 24\tHours ") == "open24\thours"  # spaces only, as Flow-GRPO
    assert ocr_score("OPEN 24 HOURS", "open 24 hours") == 1.0
    assert ocr_score("welcome, open 24 hours!", "Open 24 Hours") == 1.0  # a substring: distance 0
    assert ocr_score("hellp", "hello") == pytest.approx(0.8)
    assert ocr_score("helo", "hello") == pytest.approx(0.8)
    assert ocr_score("", "hello") == 0.0
    # Long unrelated text: the distance 7 is capped at len("xy") = 2, so the score is 0, not negative.
    assert levenshtein("abcdefg", "xy") == 7
    assert ocr_score("abcdefg", "xy") == 0.0
    assert ocr_score("x", "xy") == 0.5
    with pytest.raises(ValueError, match="character other than a space"):
        ocr_score("x", "   ")


@given(
    st.text("abAB 1", max_size=12), st.text("abAB 1", min_size=1, max_size=6).filter(lambda t: t.strip(" "))
)
def test_ocr_score_range_and_normalisation(recognized, target):
    score = ocr_score(recognized, target)
    assert 0.0 <= score <= 1.0
    assert score == ocr_score(recognized.upper().replace(" ", ""), " ".join(target.lower()))
    assert ocr_score(f"xx{recognized}{target}yy", target) == 1.0  # the target inside: full marks
    t, r = normalize_text(target), normalize_text(recognized)
    assert score == pytest.approx(1 - min(levenshtein(r, t), len(t)) / len(t)) or t in r


# OCR: RapidOCR for real ---------------------------------------------------------------------------


def render_text(text: str, size: tuple[int, int] = (256, 128), font_size: int = 48) -> torch.Tensor:
    """Black ``text`` centred on white, as a ``[1, 3, H, W]`` tensor in [0, 1]."""
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=font_size)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text(((size[0] - right - left) / 2, (size[1] - bottom - top) / 2), text, fill="black", font=font)
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)[None].float() / 255


@pytest.fixture(scope="module")
def ocr():  # RapidOCR is installed by the set-up (the ocr extra): a missing one fails, not skips
    return OcrReward(options={"intra_op_num_threads": 1, "inter_op_num_threads": 1})


def test_ocr_reads_rendered_text(ocr):
    assert isinstance(ocr, Reward)
    hello, blank = render_text("hello"), torch.ones(1, 3, 128, 256)
    images = torch.cat([hello, hello, blank, hello, hello])
    prompts = [
        'a sign that says "hello"',
        'a sign that says "world"',
        'a sign that says "hello"',
        "a sign with no quoted text",
        "a sign",
    ]
    metadata = [{}, {}, {}, {}, {"text": "help"}]
    scores = ocr(images, prompts, metadata)
    assert scores.shape == (5,)
    assert scores.dtype == torch.float32
    assert scores[0] >= 0.9
    assert scores[1] <= 0.3  # "world" is 4 edits from "hello": 0.2
    assert scores[2] == 0.0  # nothing read
    assert math.isnan(scores[3])
    assert scores[4] == pytest.approx(0.5)  # metadata["text"] wins: "hello" is 2 edits from "help"
    with pytest.raises(ValueError, match=r"metadata\['text'\] must be a string"):
        ocr(hello, ["x"], [{"text": 3}])


def test_ocr_on_small_images_and_upscaling(ocr):
    small = render_text("cat", size=(64, 64), font_size=16)
    assert ocr(small, ['the word "cat"'], [{}]).item() == 1.0
    upscaled = OcrReward(min_size=256, options={"intra_op_num_threads": 1, "det_limit_side_len": 320})
    assert upscaled.recognize((small[0].permute(1, 2, 0).numpy() * 255).astype(np.uint8)) == "cat"
    assert upscaled(small, ['the word "cat"'], [{}]).item() == 1.0
    with pytest.raises(ValueError, match="min_size must be a non-negative integer"):
        OcrReward(min_size=-1)


def test_ocr_is_registered():
    assert "ocr" in available_rewards()
    assert "geneval" in available_rewards()


# GenEval: the rules -------------------------------------------------------------------------------


def det(label, box=(0, 0, 10, 10), score=0.95, color=None):
    return Detection(label, score, box, color)


LEFT, RIGHT = (0, 40, 20, 60), (60, 40, 80, 60)  # two boxes side by side, y pointing down
TOP, BOTTOM = (40, 0, 60, 20), (40, 60, 60, 80)

SINGLE = {"tag": "single_object", "include": [{"class": "cat", "count": 1}]}
TWO = {"tag": "two_object", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}]}
THREE_DOGS = {
    "tag": "counting",
    "include": [{"class": "dog", "count": 3}],
    "exclude": [{"class": "dog", "count": 4}],
}
RED_CAR = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}
RED_CAR_BLUE_BENCH = {
    "tag": "color_attr",
    "include": [
        {"class": "car", "count": 1, "color": "red"},
        {"class": "bench", "count": 1, "color": "blue"},
    ],
}


def position(relation):
    """``a photo of a cat {relation} a dog`` (the dog is clause 0)."""
    include = [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": [relation, 0]}]
    return {"tag": "position", "include": include}


# (metadata, detections, correct (GenEval), strict (Flow-GRPO), partial (Flow-GRPO's reward))
CASES = {
    "single: one": (SINGLE, [det("cat", score=0.5)], True, True, 1.0),
    "single: at the threshold 0.3 is not detected": (SINGLE, [det("cat", score=0.3)], False, False, 0.0),
    "single: none": (SINGLE, [det("dog")], False, False, 0.0),
    "single: two, at least one for GenEval, not exactly one": (
        SINGLE,
        [det("cat"), det("cat")],
        True,
        False,
        0.0,
    ),
    "single: three give a negative count term": (SINGLE, [det("cat")] * 3, True, False, -1.0),
    "two: both": (TWO, [det("cat"), det("dog")], True, True, 1.0),
    "two: one of two": (TWO, [det("cat")], False, False, 0.5),
    "counting: exact": (THREE_DOGS, [det("dog")] * 3, True, True, 1.0),
    "counting: 0.85 is below the counting threshold": (
        THREE_DOGS,
        [det("dog"), det("dog"), det("dog", score=0.85)],
        False,
        False,
        2 / 3,
    ),
    "counting: too few": (THREE_DOGS, [det("dog")] * 2, False, False, 2 / 3),
    "counting: too many, the exclude rule": (THREE_DOGS, [det("dog")] * 4, False, False, 2 / 3),
    "counting: far too many": (THREE_DOGS, [det("dog")] * 9, False, False, -1.0),
    "colors: right": (RED_CAR, [det("car", color="red")], True, True, 1.0),
    "colors: wrong colour": (RED_CAR, [det("car", color="blue")], False, False, 0.5),
    "colors: no car": (RED_CAR, [], False, False, 0.0),
    "colors: the most confident of two is red": (
        RED_CAR,
        [det("car", score=0.9, color="red"), det("car", score=0.8, color="blue")],
        True,
        False,
        0.0,
    ),
    "colors: the most confident of two is blue": (
        RED_CAR,
        [det("car", score=0.8, color="red"), det("car", score=0.9, color="blue")],
        False,
        False,
        0.0,
    ),
    "color_attr: both right": (
        RED_CAR_BLUE_BENCH,
        [det("car", color="red"), det("bench", color="blue")],
        True,
        True,
        1.0,
    ),
    "color_attr: one wrong": (
        RED_CAR_BLUE_BENCH,
        [det("car", color="red"), det("bench", color="green")],
        False,
        False,
        0.75,
    ),
    "color_attr: swapped": (
        RED_CAR_BLUE_BENCH,
        [det("car", color="blue"), det("bench", color="red")],
        False,
        False,
        0.5,
    ),
    "color_attr: no bench": (RED_CAR_BLUE_BENCH, [det("car", color="red")], False, False, 0.5),
    "position: left of": (position("left of"), [det("cat", LEFT), det("dog", RIGHT)], True, True, 1.0),
    "position: right of": (position("right of"), [det("cat", RIGHT), det("dog", LEFT)], True, True, 1.0),
    "position: above": (position("above"), [det("cat", TOP), det("dog", BOTTOM)], True, True, 1.0),
    "position: below": (position("below"), [det("cat", BOTTOM), det("dog", TOP)], True, True, 1.0),
    # A wrong relation adds 0 and then 1 (Flow-GRPO): terms 1, 1, 0, 1.
    "position: wrong side": (position("left of"), [det("cat", RIGHT), det("dog", LEFT)], False, False, 0.75),
    "position: within the margin": (
        position("left of"),
        [det("cat", (0, 0, 10, 10)), det("dog", (1.5, 0, 11.5, 10))],
        False,
        False,
        0.75,
    ),
    "position: just beyond the margin": (
        position("left of"),
        [det("cat", (0, 0, 10, 10)), det("dog", (5, 0, 15, 10))],
        True,
        True,
        1.0,
    ),
    # No dog: the count term 0 for the dog; the cat's count 1, then 0 for "no target".
    "position: no target": (position("left of"), [det("cat", LEFT)], False, False, 1 / 3),
    "position: no cat": (position("left of"), [det("dog", RIGHT)], False, False, 1 / 3),
    "position: two dogs, one on the wrong side": (
        position("left of"),
        [det("cat", (30, 40, 50, 60)), det("dog", RIGHT), det("dog", LEFT, score=0.5)],
        True,  # GenEval looks at the most confident dog only
        False,
        1 / 3,  # terms: 1 - 1/1 for two dogs (not exactly one: no target), the cat's 1, 0 for no target
    ),
}


@pytest.mark.parametrize(
    ("metadata", "detections", "correct", "strict", "partial"), CASES.values(), ids=CASES
)
def test_geneval_rules(metadata, detections, correct, strict, partial):
    result = evaluate(metadata, detections)
    assert result.correct is correct
    assert result.strict is strict
    assert result.partial == pytest.approx(partial)
    assert (result.reason == "") == (correct and strict)


def test_geneval_reasons():
    reason = evaluate(THREE_DOGS, [det("dog")] * 4).reason
    assert reason.splitlines() == ["expected dog < 4, found 4", "expected dog == 3, found 4"]
    reason = evaluate(RED_CAR, [det("car", color="blue")]).reason
    assert "expected red car >= 1, found 1 blue" in reason
    reason = evaluate(position("left of"), [det("cat", RIGHT), det("dog", LEFT)]).reason
    assert reason == "expected cat left of target, found right of"
    assert evaluate(position("left of"), [det("cat", LEFT)]).reason.splitlines() == [
        "expected dog >= 1, found 0",
        "no target for cat to be left of",
        "expected dog == 1, found 0",
    ]


def test_relative_position():
    assert relative_position(LEFT, RIGHT) == {"left of"}
    assert relative_position(RIGHT, LEFT) == {"right of"}
    assert relative_position(TOP, BOTTOM) == {"above"}
    assert relative_position(BOTTOM, TOP) == {"below"}
    assert relative_position(LEFT, LEFT) == set()
    # Offset (-1.5, 0) within the margin 0.1 * (10 + 10) = 2: no relation; (-5, 0): beyond it.
    assert relative_position((0, 0, 10, 10), (1.5, 0, 11.5, 10)) == set()
    assert relative_position((0, 0, 10, 10), (5, 0, 15, 10)) == {"left of"}
    assert relative_position((0, 0, 10, 10), (5, 0, 15, 10), margin=0.3) == set()
    # Diagonals: (-20, -20) is both; (-10, -20) leaves (-8, -18) / 22.4 = (-0.36, -0.80): above only.
    assert relative_position((0, 0, 10, 10), (20, 20, 30, 30)) == {"left of", "above"}
    assert relative_position((0, 0, 10, 10), (10, 20, 20, 30)) == {"above"}


def test_box_iou_counts_pixels_inclusively():
    assert box_iou((0, 0, 9, 9), (0, 0, 9, 9)) == 1.0
    assert box_iou((0, 0, 9, 9), (20, 20, 29, 29)) == 0.0
    assert box_iou((0, 0, 9, 9), (5, 0, 14, 9)) == pytest.approx(50 / 150)


def test_select_objects():
    found = [det("cat", score=s) for s in (0.31, 0.3, 0.95, 0.5)] + [det("dog", score=0.2)]
    selected = select_objects(found, "single_object")
    assert list(selected) == ["cat"]
    assert [d.score for d in selected["cat"]] == [0.95, 0.5, 0.31]
    assert [d.score for d in select_objects(found, "counting")["cat"]] == [0.95]
    many = [det("cat", (i, 0, i + 10, 10), score=0.5 + i / 100) for i in range(20)]
    assert len(select_objects(many, "single_object")["cat"]) == MAX_OBJECTS
    twins = [det("cat", score=0.9), det("cat", score=0.8), det("cat", (50, 50, 60, 60), score=0.7)]
    assert len(select_objects(twins, "single_object")["cat"]) == 3  # NMS threshold 1.0 keeps all
    assert [d.score for d in select_objects(twins, "single_object", nms_threshold=0.5)["cat"]] == [0.9, 0.7]
    again = [d for objects in selected.values() for d in objects]
    assert select_objects(again, "single_object") == selected


@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        ({"tag": "count", "include": [{"class": "cat", "count": 1}]}, "tag must be one of"),
        ({"tag": "single_object", "include": []}, "include must be a non-empty list"),
        ({"tag": "single_object", "include": [{"count": 1}]}, r"include\[0\] must be a dict with a 'class'"),
        (
            {"tag": "counting", "include": [{"class": "cat", "count": 0}]},
            r"include\[0\].count must be a positive",
        ),
        (
            {"tag": "colors", "include": [{"class": "cat", "count": 1, "color": "teal"}]},
            r"include\[0\].color",
        ),
        (
            {"tag": "position", "include": [{"class": "cat", "count": 1, "position": ["left of", 0]}]},
            r"include\[0\].position must be \[relation, index\]",
        ),
        (
            {
                "tag": "position",
                "include": [{"class": "a", "count": 1}, {"class": "b", "count": 1, "position": ["near", 0]}],
            },
            r"include\[1\].position",
        ),
        (
            {
                "tag": "counting",
                "include": [{"class": "a", "count": 1}],
                "exclude": [{"class": "a", "count": -1}],
            },
            r"exclude\[0\].count",
        ),
    ],
)
def test_bad_metadata(metadata, match):
    with pytest.raises(ValueError, match=match):
        check_metadata(metadata)


def test_a_colour_is_needed_where_the_prompt_asks_for_one():
    with pytest.raises(ValueError, match="'car' detection has no colour"):
        evaluate(RED_CAR, [det("car")])
    assert evaluate(SINGLE, [det("cat")]).correct  # no colour asked: none needed
    with pytest.raises(ValueError, match="a box must be finite"):
        Detection("cat", 0.9, (10, 0, 0, 10))


def test_hsv_colour_classifier():
    reference = {
        "red": (230, 25, 25),
        "orange": (255, 140, 0),
        "yellow": (255, 220, 0),
        "green": (30, 160, 50),
        "blue": (30, 60, 220),
        "purple": (128, 0, 128),
        "pink": (255, 192, 203),
        "brown": (139, 69, 19),
        "black": (10, 10, 10),
        "white": (245, 245, 245),
    }
    assert list(reference) == list(GENEVAL_COLORS)
    pixels = np.array(list(reference.values()), dtype=np.uint8)
    assert [GENEVAL_COLORS[i] for i in HsvColorClassifier.pixel_colors(pixels)] == list(reference)
    # A blue object on a white background: the box's centre decides.
    image = np.full((40, 40, 3), 255, np.uint8)
    image[10:30, 5:25] = (30, 60, 220)
    classify = HsvColorClassifier()
    assert classify(image, [(0, 0, 30, 40), (30, 0, 40, 40)], "cup") == ["blue", "white"]
    assert classify(image, [(-5, -5, 0.2, 0.2)], "cup") == ["white"]  # outside: clamped to a pixel
    with pytest.raises(ValueError, match="center must be in"):
        HsvColorClassifier(center=0)


# GenEval: the reward ------------------------------------------------------------------------------


def two_boxes_image(left_rgb=(220, 30, 30), right_rgb=(30, 60, 220)) -> torch.Tensor:
    """A 64 x 64 white image with a coloured rectangle on each side: boxes LEFT_BOX and RIGHT_BOX."""
    image = np.full((64, 64, 3), 255, np.uint8)
    image[20:44, 4:24] = left_rgb
    image[20:44, 40:60] = right_rgb
    return torch.from_numpy(image).permute(2, 0, 1).float() / 255


LEFT_BOX, RIGHT_BOX = (4, 20, 24, 44), (40, 20, 60, 44)


class BoxFinder:
    """A :class:`Detector` that reports a car at LEFT_BOX and a bench at RIGHT_BOX in every image."""

    labels = frozenset(GENEVAL_CLASSES)

    def __init__(self):
        self.calls = 0

    def __call__(self, images):
        assert images.dtype == np.uint8
        assert images.shape[1:] == (64, 64, 3)
        self.calls += 1
        return [[Detection("car", 0.9, LEFT_BOX), Detection("bench", 0.8, RIGHT_BOX)] for _ in images]


def test_geneval_reward_reads_colours_and_places_from_pixels():
    finder = BoxFinder()
    reward = GenEvalReward(finder)
    assert isinstance(reward, Reward)
    images = torch.stack([two_boxes_image(), two_boxes_image(), two_boxes_image(), two_boxes_image()])
    car_bench = [{"class": "car", "count": 1}, {"class": "bench", "count": 1}]
    swapped = [dict(c, color=k) for c, k in zip(car_bench, ("blue", "red"), strict=True)]
    bench_left = [car_bench[0], dict(car_bench[1], position=["left of", 0])]
    metadata = [
        {**RED_CAR_BLUE_BENCH},
        {"tag": "color_attr", "include": swapped},
        {"tag": "position", "include": bench_left},
        {},
    ]
    prompts = ["a red car and a blue bench", "a blue car and a red bench", "a bench left of a car", "x"]
    scores = reward(images, prompts, metadata)
    assert scores.dtype == torch.float32
    assert scores[:3].tolist() == [1.0, 0.5, 0.75]
    assert math.isnan(scores[3])
    assert GenEvalReward(finder, score="strict")(images, prompts, metadata)[:3].tolist() == [1.0, 0.0, 0.0]
    results = reward.results(images, prompts, metadata)
    assert results[3] is None
    assert results[2].reason == "expected bench left of target, found right of"
    calls = finder.calls
    assert torch.isnan(reward(images[:1], ["x"], [{}])).all()
    assert finder.calls == calls  # no GenEval metadata: the detector does not run


def test_geneval_reward_errors():
    reward = GenEvalReward(BoxFinder())
    image = two_boxes_image()[None]
    with pytest.raises(ValueError, match=r"metadata\[0\]: include\[0\].count"):
        reward(image, ["x"], [{"tag": "counting", "include": [{"class": "car", "count": 0}]}])
    with pytest.raises(ValueError, match=r"metadata\[0\]: class 'unicorn' is not a label of the detector"):
        reward(image, ["x"], [{"tag": "single_object", "include": [{"class": "unicorn", "count": 1}]}])
    with pytest.raises(ValueError, match="the detector returned 0 results for 1 images"):
        GenEvalReward(lambda images: [])(image, ["x"], [SINGLE])
    with pytest.raises(ValueError, match="score must be"):
        GenEvalReward(BoxFinder(), score="mean")
    with pytest.raises(ValueError, match="device apply to a detector loaded by name"):
        GenEvalReward(BoxFinder(), device="cpu")
    with pytest.raises(TypeError, match="detector must be"):
        GenEvalReward(3)


# GenEval: a tiny real transformers detector -------------------------------------------------------

COCO_LIKE = ["N/A", "person", "car", "cat", "dog", "mouse", "remote", "keyboard", "bench"]
DETECTION_TOKENS = 5


@pytest.fixture(scope="module")
def yolos_dir(tmp_path_factory):
    config = transformers.YolosConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=[64, 64],
        patch_size=16,
        num_detection_tokens=DETECTION_TOKENS,
        id2label=dict(enumerate(COCO_LIKE)),
        label2id={name: i for i, name in enumerate(COCO_LIKE)},
    )
    torch.manual_seed(0)
    model = transformers.YolosForObjectDetection(config)
    with torch.no_grad():  # spread the detection tokens, so boxes differ
        model.vit.embeddings.detection_tokens.normal_()
    path = tmp_path_factory.mktemp("yolos")
    model.save_pretrained(path)
    transformers.YolosImageProcessor(size={"shortest_edge": 64, "longest_edge": 64}).save_pretrained(path)
    return path


def test_transformers_detector(yolos_dir):
    detector = TransformersDetector.from_pretrained(yolos_dir, threshold=0.0)
    assert detector.labels == {
        "N/A",
        "person",
        "car",
        "cat",
        "dog",
        "computer mouse",
        "tv remote",
        "computer keyboard",
        "bench",
    }
    images = np.random.default_rng(0).integers(0, 256, (3, 48, 80, 3), dtype=np.uint8)
    found = detector(images)
    assert len(found) == 3
    for detections in found:
        assert len(detections) == DETECTION_TOKENS  # threshold 0 keeps every query
        for d in detections:
            assert isinstance(d, Detection)
            assert d.label in detector.labels
            assert 0 <= d.score <= 1
            x0, y0, x1, y1 = d.box
            assert x0 <= x1
            assert y0 <= y1
    assert TransformersDetector.from_pretrained(yolos_dir)(images) == [
        [],
        [],
        [],
    ]  # random: nothing above 0.3
    with pytest.raises(ValueError, match=r"\[B, H, W, 3\] uint8"):
        detector(images.astype(np.float32))


def test_geneval_reward_with_a_detector_by_name(yolos_dir):
    reward = make_reward("geneval", detector=str(yolos_dir), score="correct")
    images = torch.stack([two_boxes_image(), two_boxes_image()])
    scores = reward(images, ["a photo of a cat", "x"], [SINGLE, {}])
    assert scores[0].item() == 0.0  # nothing detected above 0.3
    assert math.isnan(scores[1])
    assert reward.to("cpu") is reward


def test_detector_loading_errors(tmp_path, yolos_dir):
    with pytest.raises(FileNotFoundError, match=r"detector directory .*missing.* does not exist"):
        TransformersDetector.from_pretrained(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="nor is it a hub id"):
        GenEvalReward("not a model")
    with pytest.raises(
        OSError, match=r"could not load detector 'mogo-test/no-such-detector' from the local hub cache"
    ):
        TransformersDetector.from_pretrained("mogo-test/no-such-detector")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        TransformersDetector.from_pretrained(tmp_path / "file.txt")
    with pytest.raises(ValueError, match="revision='main' applies to hub ids"):
        TransformersDetector.from_pretrained(yolos_dir, revision="main")


# Prompt sets --------------------------------------------------------------------------------------


def test_load_prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text('# a comment\na red square\n\n   \n  a sign that says "#1"  \n#another\n')
    loaded = load_prompts(path)
    assert loaded.prompts == ["a red square", 'a sign that says "#1"']
    assert loaded.metadata == [{}, {}]
    with pytest.raises(FileNotFoundError, match=r"prompt file .*nope\.txt.* does not exist"):
        load_prompts(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="has no prompts"):
        load_prompts(tmp_path / "empty.txt")


def test_load_geneval_metadata_round_trip(tmp_path):
    generated = geneval_prompts(12, seed=3)
    path = tmp_path / "evaluation_metadata.jsonl"
    path.write_text("\n".join(json.dumps(m) for m in generated.metadata) + "\n\n")
    loaded = load_geneval_metadata(path)
    assert loaded == generated
    lines = path.read_text().splitlines()
    for number, bad, match in [
        (2, "{not json", "Expecting property name"),
        (3, json.dumps({"tag": "colors", "include": [{"class": "cat", "count": 1}]}), "non-empty 'prompt'"),
        (1, json.dumps({"prompt": "p", "tag": "colors", "include": [{"class": "c", "count": 2.5}]}), "count"),
    ]:
        broken = lines.copy()
        broken[number - 1] = bad
        path.write_text("\n".join(broken))
        with pytest.raises(ValueError, match=rf"evaluation_metadata.jsonl:{number}: .*{match}"):
            load_geneval_metadata(path)
    path.write_text("\n")
    with pytest.raises(ValueError, match="has no prompts"):
        load_geneval_metadata(path)
    with pytest.raises(FileNotFoundError, match="GenEval metadata file"):
        load_geneval_metadata(tmp_path / "none.jsonl")


def test_prompt_files_read_as_written(tmp_path):
    """A byte-order mark is not text, upper-case ``.JSONL`` is GenEval metadata, a key given twice
    and a file that is not UTF-8 are errors naming the file and what is wrong."""
    text = tmp_path / "bom.txt"
    text.write_bytes("\ufeff# a comment\na red square\n".encode())
    assert load_prompts(text).prompts == ["a red square"]
    upper = tmp_path / "META.JSONL"
    upper.write_text(json.dumps(geneval_prompts(1, seed=0).metadata[0]) + "\n")
    assert load_prompt_set(upper) == load_geneval_metadata(upper)
    twice = tmp_path / "twice.jsonl"
    entry = json.dumps(geneval_prompts(1, seed=0).metadata[0])
    twice.write_text(entry[:-1] + ', "prompt": "a cat"}\n')
    with pytest.raises(ValueError, match=r"twice.jsonl:1: key 'prompt' appears twice"):
        load_geneval_metadata(twice)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("a caf\xe9 sign\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"prompt file .*latin\.txt.* is not UTF-8 text: byte 5 \(0xe9\)"):
        load_prompts(latin)


def test_ocr_prompts():
    first = ocr_prompts(40, seed=1)
    assert first == ocr_prompts(40, seed=1)
    assert first != ocr_prompts(40, seed=2)
    assert len(set(first.prompts)) == 40  # no repeat before every pair is drawn
    for prompt, metadata in zip(*first, strict=True):
        assert quoted_text(prompt) == metadata["text"]
        assert any(prompt == t.format(metadata["text"]) for t in OCR_TEMPLATES)
    assert len(ocr_prompts(1000).prompts) == 1000
    with pytest.raises(ValueError, match="n must be a positive integer"):
        ocr_prompts(0)


def test_geneval_prompts_follow_geneval():
    generated = geneval_prompts(12, seed=0)
    assert generated == geneval_prompts(12, seed=0)
    assert generated != geneval_prompts(12, seed=1)
    assert [m["tag"] for m in generated.metadata] == list(GENEVAL_TAGS) * 2
    for prompt, metadata in zip(*generated, strict=True):
        check_metadata(metadata)
        assert metadata["prompt"] == prompt
        assert set(metadata) <= {"tag", "include", "exclude", "prompt"}
        assert all(c["class"] in GENEVAL_CLASSES for c in metadata["include"])
    counting = geneval_prompts(30, seed=0, tags=["counting"]).metadata
    assert {m["include"][0]["count"] for m in counting} == {2, 3, 4}
    assert all(
        m["exclude"] == [{"class": m["include"][0]["class"], "count": m["include"][0]["count"] + 1}]
        for m in counting
    )
    colored = geneval_prompts(200, seed=0, tags=["colors", "color_attr"]).metadata
    assert all(c["class"] != "person" for m in colored for c in m["include"])
    for prompt, metadata in zip(*geneval_prompts(60, seed=0), strict=True):
        assert prompt == geneval_text(metadata)
    with pytest.raises(ValueError, match="tags must be a non-empty list"):
        geneval_prompts(3, tags=["shapes"])


def geneval_text(metadata):
    """The prompt GenEval writes for ``metadata`` (its articles and plurals: "an apple", "skises")."""

    def a(word):
        return f"an {word}" if word[0] in "aeiou" else f"a {word}"

    include = metadata["include"]
    named = [a(f"{c['color']} {c['class']}" if "color" in c else c["class"]) for c in include]
    if metadata["tag"] == "counting":
        name, count = include[0]["class"], include[0]["count"]
        return f"a photo of {['two', 'three', 'four'][count - 2]} {name}{'es' if name[-1] == 's' else 's'}"
    if metadata["tag"] == "position":
        return f"a photo of {named[1]} {include[1]['position'][0]} {named[0]}"
    return "a photo of " + " and ".join(named)


def perfect_detections(metadata):
    """What a perfect image of ``metadata`` shows: each clause's objects where its position says."""
    boxes: list[list[tuple[float, float, float, float]]] = []
    found = []
    shift = {"left of": (-200, 0), "right of": (200, 0), "above": (0, -200), "below": (0, 200)}
    for i, clause in enumerate(metadata["include"]):
        if "position" in clause:
            relation, target = clause["position"]
            x0, y0, x1, y1 = boxes[target][0]
            dx, dy = shift[relation]
            own = [(x0 + dx, y0 + dy, x1 + dx, y1 + dy)] * clause["count"]
        else:
            own = [(1000 * i + 30 * j, 1000, 1000 * i + 30 * j + 20, 1020) for j in range(clause["count"])]
        boxes.append(own)
        found += [Detection(clause["class"], 0.95, box, clause.get("color")) for box in own]
    return found


@given(st.integers(0, 2**32 - 1))
def test_generated_prompts_are_correct_on_perfect_detections(seed):
    for metadata in geneval_prompts(18, seed=seed).metadata:
        result = evaluate(metadata, perfect_detections(metadata))
        assert result == (True, True, 1.0, ""), metadata


EMPTY_TESTED = ("ocr", "geneval")  # the rewards of this file tested on an empty batch


def test_ocr_and_geneval_on_an_empty_batch_and_on_zero_size_images(ocr):
    """D18: ocr on a [1, 3, 0, 0] image raised ZeroDivisionError; a zero-size image is refused by
    name, and an empty batch scores an empty [0]."""
    for reward in (ocr, GenEvalReward(BoxFinder())):
        scores = reward(torch.zeros(0, 3, 64, 64), [], [])
        assert scores.shape == (0,)
        assert scores.dtype == torch.float32
        with pytest.raises(ValueError, match=r"images must have at least 1 x 1 pixels, got \(1, 3, 0, 0\)"):
            reward(torch.zeros(1, 3, 0, 0), ['a sign that says "hi"'], [SINGLE])


def test_an_unknown_rapidocr_option_is_named():
    """D18: RapidOCR silently ignores a keyword it does not know (a typo in a config)."""
    with pytest.raises(
        ValueError, match=r"options: RapidOCR has no option 'text_scor' \(did you mean 'text_score'\?\)"
    ):
        make_reward("ocr", options={"text_scor": 0.5})
    documented = {
        "use_cls",
        "text_score",
        "det_limit_side_len",
        "intra_op_num_threads",
    }  # OcrReward's docstring
    assert documented <= _rapidocr_options()  # fails loudly when RapidOCR changes its layout
    OcrReward(options={"text_score": 0.5, "det_limit_side_len": 320, "det_donot_use_dilation": False})
