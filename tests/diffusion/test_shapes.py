"""The shapes world: scenes and their metadata, the detector, and the pretraining command."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from torch.nn import functional

from mogo_diffusion.shapes import (
    BACKGROUNDS,
    COLORS,
    HELDOUT_PAIRS,
    OBJECT_COLORS,
    SHAPES,
    SIZE,
    TAGS,
    Object,
    Scene,
    all_prompts,
    check,
    detect,
    detect_batch,
    relations,
    render,
    render_batch,
    sample_scenes,
    shapes_clip_path,
    shapes_pipeline_path,
)
from mogo_diffusion.shapes.scenes import GAP, MAX_SEQUENCE_LENGTH

# Scenes -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scenes() -> dict[str, list[Scene]]:
    return {split: sample_scenes(400, 7, split) for split in ("train", "heldout")}


def test_scenes_are_deterministic_and_extend():
    first = sample_scenes(40, 3)
    assert first == sample_scenes(40, 3)
    assert sample_scenes(60, 3)[:40] == first
    assert first != sample_scenes(40, 4)
    torch.testing.assert_close(render_batch(first), render_batch(sample_scenes(40, 3)), atol=0, rtol=0)


def test_scenes_are_well_formed(scenes):
    for split, pool in scenes.items():
        tags = Counter(s.tag for s in pool)
        expected = set(TAGS) if split == "train" else {"colors", "counting", "position", "color_attr"}
        assert set(tags) == expected
        for scene in pool:
            assert scene.background in BACKGROUNDS
            for obj in scene.objects:
                x0, y0, x1, y1 = obj.box
                assert 0 < x0 < x1 < SIZE
                assert 0 < y0 < y1 < SIZE
                assert x1 - x0 == y1 - y0 >= 8
                assert obj.color in OBJECT_COLORS
                assert obj.shape in SHAPES
            for a, b in zip(scene.objects, scene.objects[1:], strict=False):
                gaps = (a.box[0] - b.box[2], b.box[0] - a.box[2], a.box[1] - b.box[3], b.box[1] - a.box[3])
                assert max(gaps) >= GAP
            if scene.tag == "position":
                assert relations(scene.objects[1].box, scene.objects[0].box) == {scene.relation}
            if scene.tag in ("two_object", "color_attr", "position"):
                assert scene.objects[0].shape != scene.objects[1].shape
            if scene.tag == "counting":
                assert len({(o.shape, o.color) for o in scene.objects}) == 1
    image = render(scenes["train"][0])
    assert image.shape == (3, SIZE, SIZE)
    assert image.dtype == torch.float32
    colours = {tuple(c) for c in image.permute(1, 2, 0).reshape(-1, 3).unique(dim=0).tolist()}
    assert colours <= set(COLORS.values())
    assert render(scenes["train"][0], size=64).shape == (3, 64, 64)


def test_captions_and_metadata_agree(scenes):
    for scene in scenes["train"] + scenes["heldout"]:
        meta = scene.metadata
        assert meta["prompt"] == scene.prompt
        assert meta["tag"] == scene.tag
        assert meta["background"] == scene.background
        assert scene.prompt.endswith(f"on a {scene.background} background")
        counted = Counter()
        for entry in meta["include"]:
            counted[entry["class"]] += entry["count"]
            assert entry["class"] in scene.prompt
            if "color" in entry:
                assert f"{entry['color']} {entry['class']}" in scene.prompt
                assert entry["color"] in [o.color for o in scene.objects if o.shape == entry["class"]]
            else:
                assert not any(c in scene.prompt for c in OBJECT_COLORS)
        assert counted == Counter(o.shape for o in scene.objects)
        if scene.tag == "position":
            target = meta["include"][1]
            assert target["position"] == [scene.relation, 0]
            assert f" {scene.relation} " in scene.prompt
        if scene.tag == "counting":
            assert meta["exclude"] == [{"class": scene.objects[0].shape, "count": len(scene.objects) + 1}]
            assert scene.prompt.startswith(("two ", "three "))
    example = Scene(
        "position",
        "white",
        (Object("square", "blue", (18, 8, 28, 18)), Object("circle", "red", (2, 8, 12, 18))),
        "left of",
    )
    assert example.prompt == "a red circle left of a blue square on a white background"
    assert example.metadata["include"] == [
        {"class": "square", "count": 1, "color": "blue"},
        {"class": "circle", "count": 1, "color": "red", "position": ["left of", 0]},
    ]


def test_heldout_split_is_disjoint_from_training(scenes):
    train, heldout = all_prompts("train"), all_prompts("heldout")
    assert len(set(train)) == len(train)
    assert len(set(heldout)) == len(heldout)
    assert not set(train) & set(heldout)
    assert {s.prompt for s in scenes["train"]} <= set(train)
    assert {s.prompt for s in scenes["heldout"]} <= set(heldout)
    for scene in scenes["train"]:  # held-out pairs are neither named nor drawn
        assert not {(o.color, o.shape) for o in scene.objects} & HELDOUT_PAIRS
    for scene in scenes["heldout"]:
        named = {(e["color"], e["class"]) for e in scene.metadata["include"]}
        assert named & HELDOUT_PAIRS


def test_the_shipped_tokenizers_read_every_caption_word_by_word():
    """Each word of a caption is one token, so no caption is cut and none carries padding it need not."""
    from transformers import AutoTokenizer

    from mogo_diffusion.shapes import shapes_clip_path, shapes_pipeline_path
    from mogo_diffusion.shapes.scenes import corpus

    captions = corpus()
    words = [len(caption.split()) for caption in captions]
    assert max(words) + 2 == MAX_SEQUENCE_LENGTH
    readers = {"tokenizer": 2, "tokenizer_2": 2, "tokenizer_3": 1}  # CLIP's start and end; T5's end
    for folder, extra in readers.items():
        tokenizer = AutoTokenizer.from_pretrained(shapes_pipeline_path() / folder)
        assert tokenizer.model_max_length == MAX_SEQUENCE_LENGTH
        assert [len(ids) for ids in tokenizer(captions).input_ids] == [n + extra for n in words]
    clip = AutoTokenizer.from_pretrained(shapes_clip_path())
    assert [len(ids) for ids in clip(captions).input_ids] == [n + 2 for n in words]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="split must be"):
        sample_scenes(1, 0, "test")
    with pytest.raises(ValueError, match="n must be"):
        sample_scenes(-1)
    with pytest.raises(ValueError, match=r"unknown tags \['colours'\]"):
        sample_scenes(1, tag_weights={"colours": 1.0})
    with pytest.raises(ValueError, match="positive sum"):
        sample_scenes(1, split="heldout", tag_weights={"single_object": 1.0})
    assert {s.tag for s in sample_scenes(20, tag_weights={"counting": 1.0})} == {"counting"}
    with pytest.raises(ValueError, match="relation must be given"):
        Scene("colors", "white", (Object("circle", "red", (1, 1, 9, 9)),), "above")
    with pytest.raises(ValueError, match="needs"):
        Scene("colors", "white", ())
    with pytest.raises(ValueError, match="unknown shape"):
        Scene("colors", "white", (Object("star", "red", (1, 1, 9, 9)),))


def test_relations_follow_geneval():
    left, right = (0, 10, 10, 20), (20, 10, 30, 20)
    assert relations(left, right) == {"left of"}
    assert relations(right, left) == {"right of"}
    assert relations((10, 0, 20, 10), (10, 20, 20, 30)) == {"above"}
    assert relations((0, 0, 10, 10), (20, 20, 30, 30)) == {"left of", "above"}
    assert relations((0, 0, 10, 10), (1, 0, 11, 10)) == set()


# Detector -----------------------------------------------------------------------------------------


def _blur(images: torch.Tensor, sigma: float) -> torch.Tensor:
    x = torch.arange(-2, 3, dtype=torch.float32)
    kernel = torch.exp(-(x**2) / (2 * sigma**2))
    kernel = (kernel / kernel.sum()).repeat(3, 1, 1, 1)
    images = functional.conv2d(functional.pad(images, (2, 2, 0, 0), mode="replicate"), kernel, groups=3)
    return functional.conv2d(
        functional.pad(images, (0, 0, 2, 2), mode="replicate"), kernel.transpose(2, 3), groups=3
    )


def _accuracy(images: torch.Tensor, pool: list[Scene]) -> tuple[float, float]:
    """(fraction with background and object multiset exact, fraction GenEval-correct)."""
    exact = correct = 0
    for found, scene in zip(detect_batch(images), pool, strict=True):
        objects = sorted((o.shape, o.color) for o in found.objects)
        exact += found.background == scene.background and objects == sorted(
            (o.shape, o.color) for o in scene.objects
        )
        correct += check(found, scene.metadata).correct
    return exact / len(pool), correct / len(pool)


@pytest.mark.parametrize("corruption", ["none", "noise", "blur", "blur+noise"])
def test_detector_reads_rendered_scenes(scenes, corruption):
    pool = scenes["train"][:200] + scenes["heldout"][:200]
    images = render_batch(pool)
    generator = torch.Generator().manual_seed(0)
    if "blur" in corruption:
        images = _blur(images, 0.8)
    if "noise" in corruption:
        images = (images + 0.05 * torch.randn(images.shape, generator=generator)).clamp(0, 1)
    exact, correct = _accuracy(images, pool)
    print(f"detector on {len(pool)} renders ({corruption}): exact {exact:.3f}, GenEval-correct {correct:.3f}")
    assert exact >= 0.99
    assert correct >= 0.99


def test_detections_locate_the_objects(scenes):
    for scene in scenes["train"][:100]:
        found = detect(render(scene))
        for obj in scene.objects:
            match = [o for o in found.find(obj.shape, obj.color) if o.box == _tight_box(obj)]
            assert len(match) == 1
            cx, cy = match[0].centroid
            assert obj.box[0] < cx < obj.box[2]
            assert obj.box[1] < cy < obj.box[3]
            assert match[0].distance < 0.25
    assert found.size == (SIZE, SIZE)
    assert detect(np.zeros((3, 8, 8))).objects == ()


def _tight_box(obj: Object) -> tuple[int, int, int, int]:
    from mogo_diffusion.shapes.scenes import shape_mask

    ys, xs = np.nonzero(shape_mask(obj.shape, obj.box))
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1


def test_checks_tell_what_is_wrong():
    scene = Scene(
        "position",
        "white",
        (Object("square", "blue", (18, 8, 28, 18)), Object("circle", "red", (2, 8, 12, 18))),
        "left of",
    )
    found = detect(render(scene))
    assert check(found, scene.metadata).correct
    assert check(found, scene.metadata).exact
    swapped = Scene(
        "position", "black", (scene.objects[0], Object("circle", "green", (2, 8, 12, 18))), "right of"
    )
    result = check(found, swapped.metadata)
    assert result.background is False
    assert result.position is False
    assert result.binding is False
    assert result.shapes
    assert result.counts
    assert result.colors is False
    assert not result.correct
    plain = check(found, {"include": [{"class": "circle", "count": 1}]})
    assert plain.binding is None
    assert plain.position is None
    assert plain.background is None
    assert plain.correct
    assert not plain.exact
    assert not check(found, {"include": [{"class": "circle", "count": 2}]}).counts
    assert not check(
        found, {"include": [{"class": "circle", "count": 1}], "exclude": [{"class": "circle", "count": 1}]}
    ).counts
    with pytest.raises(ValueError, match="unknown class"):
        check(found, {"include": [{"class": "dog", "count": 1}]})
    with pytest.raises(ValueError, match="image must be"):
        detect(torch.zeros(1, 3, 8, 8))


# Pretraining --------------------------------------------------------------------------------------

TINY = [
    "--scenes", "96", "--vae-steps", "2", "--vae-batch", "8", "--steps", "2", "--batch", "4", "--warmup", "1",
    "--clip-steps", "2", "--clip-batch", "8", "--eval-prompts", "2", "--eval-steps", "2", "--threads", "1",
]  # fmt: skip


def test_pretrain_runs_end_to_end_and_loads(tmp_path):
    from transformers import CLIPModel, CLIPProcessor

    from mogo_diffusion.models import encode_prompts, load_pipeline
    from mogo_diffusion.shapes.pretrain import main

    out = tmp_path / "pipe"
    report = main(["--out", str(out), *TINY])
    assert set(report) >= {"settings", "vae", "transformer", "caption_following", "clip", "seconds"}
    assert json.loads((out / "pretrain_report.json").read_text())["settings"]["steps"] == 2
    pipeline = load_pipeline(out)
    assert pipeline.vae.config.shift_factor == pytest.approx(report["vae"]["shift_factor"])
    embeds, pooled = encode_prompts(pipeline, ["a red circle on a white background"])
    assert embeds.shape == (1, 2 * MAX_SEQUENCE_LENGTH, 64)  # the CLIPs' and T5's tokens
    assert pooled.shape == (1, 64)
    model, processor = CLIPModel.from_pretrained(out / "clip"), CLIPProcessor.from_pretrained(out / "clip")
    pixels = (render(sample_scenes(1)[0]) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    inputs = processor(
        text=["a red circle on a white background"], images=[pixels], return_tensors="pt", padding=True
    )
    assert model(**inputs).logits_per_image.shape == (1, 1)
    # One phase again, alone: the CLIP reads the saved VAE; the pipeline is untouched.
    before = (out / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
    again = main(["--out", str(out), "--phases", "clip", *TINY])
    assert again["clip"]["loss"] == report["clip"]["loss"]  # deterministic
    assert (out / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() == before


@pytest.mark.parametrize("ema", [0.0, 0.5, 0.999])
def test_the_pretrained_transformer_is_the_ema_of_its_trained_weights(ema):
    """After K steps the weights are diffusers' EMAModel average of the weights after each step:
    s_1 = p_1, s_k = d_k s_(k-1) + (1 - d_k) p_k with d_k = min(ema, k / (9 + k))."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from mogo_diffusion.models import tiny_sd3
    from mogo_diffusion.shapes.pretrain import train_transformer

    transformer = tiny_sd3("smoke", seed=0).transformer
    params = [p for p in transformer.parameters() if p.requires_grad]
    trained = []  # p_k, after each optimizer step
    hook = register_optimizer_step_post_hook(lambda *_: trained.append([p.detach().double() for p in params]))
    g = torch.Generator().manual_seed(0)
    dim, pooled = transformer.config.joint_attention_dim, transformer.config.pooled_projection_dim
    try:
        train_transformer(
            transformer, torch.randn(16, 16, 4, 4, generator=g), torch.randint(0, 2, (16,), generator=g),
            torch.randn(2, 8, dim, generator=g), torch.randn(2, pooled, generator=g), shift=3.0, steps=5,
            batch=4, lr=1e-2, warmup=1, ema=ema, generator=g,
        )  # fmt: skip
    finally:
        hook.remove()
    assert len(trained) == 5
    average = trained[0]
    for k, step in enumerate(trained[1:], start=2):
        decay = min(ema, k / (9 + k))
        average = [decay * a + (1 - decay) * p for a, p in zip(average, step, strict=True)]
    for p, a, last in zip(params, average, trained[-1], strict=True):
        # each update s - (1 - d)(s - p) rounds three times (2^-24 of |w| at most) and d <= 9/14
        # shrinks what came before: |error| <= 3 * 2^-24 * max|w| / (1 - 9/14) < 9 * 2^-24 * max|w|
        bound = 9 * 2.0**-24 * float(torch.cat([a.abs().flatten(), last.abs().flatten()]).max())
        assert float((p.detach().double() - a).abs().max()) <= bound
    assert any(not torch.equal(a, last) for a, last in zip(average, trained[-1], strict=True)) == (ema > 0)


def test_pretrain_help_and_bad_arguments(tmp_path, capsys):
    from mogo_diffusion.shapes.pretrain import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert "--vae-steps" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--phases", "vae,unet"])
    assert "unknown phases ['unet']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "empty"), "--phases", "transformer"])
    assert "needs a trained VAE" in capsys.readouterr().err


def test_the_shipped_pipeline_loads_and_is_small():
    path = shapes_pipeline_path()
    from transformers import CLIPModel, CLIPProcessor

    from mogo_diffusion.models import load_pipeline

    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert size <= 20 * 2**20, f"shipped files take {size / 2**20:.1f} MiB"
    pipeline = load_pipeline(path)
    assert pipeline.transformer.config.sample_size * 4 == SIZE
    CLIPModel.from_pretrained(shapes_clip_path())
    CLIPProcessor.from_pretrained(shapes_clip_path())
