"""Without an optional dependency, each feature that needs it fails with one line naming the install
command. Each test runs Python for real in an environment that lacks the packages: a folder of
symlinks to the installed site-packages minus those packages (and their ``.dist-info``), run with
``-S -E -s`` so that the real site-packages is not on the path."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from mogo._extras import EXTRAS, MissingExtraError, require

ROOT = Path(__file__).resolve().parent.parent
SITE = Path(sysconfig.get_paths()["purelib"])


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _dist_infos(module: str) -> set[str]:
    """The normalised distribution names that provide top-level ``module``."""
    return {_normal(name) for name in importlib.metadata.packages_distributions().get(module, [])}


def run_without(tmp_path: Path, modules: tuple[str, ...], *args: str) -> subprocess.CompletedProcess:
    """Run ``python -S -E -s *args`` in a copy (by symlinks) of site-packages that lacks ``modules``;
    the working directory (first on ``sys.path``) holds the links and this checkout's packages."""
    dists = set().union(*(_dist_infos(m) for m in modules))
    for entry in SITE.iterdir():
        stem = entry.name.split(".")[0]
        dist = _normal(entry.name.split("-")[0]) if entry.name.endswith("-info") else None
        if stem in modules or dist in dists or stem in ("mogo", "mogo_diffusion"):
            continue
        (tmp_path / entry.name).symlink_to(entry)
    for package in ("mogo", "mogo_diffusion"):
        (tmp_path / package).symlink_to(ROOT / package)
    return subprocess.run(
        [sys.executable, "-S", "-E", "-s", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )


DIFFUSION = "mogo_diffusion needs the diffusion extra (missing: accelerate): pip install 'mogo[diffusion]'"


def test_the_training_command_without_the_diffusion_extra_prints_one_line(tmp_path):
    result = run_without(tmp_path, ("accelerate",), "-m", "mogo_diffusion.train", "--check")
    assert result.returncode == 1
    assert result.stderr == DIFFUSION + "\n"


def test_the_console_script_without_the_diffusion_extra_prints_one_line(tmp_path):
    """``mogo-train`` as pip writes it: a script of that name that imports and calls ``main``."""
    script = tmp_path / "mogo-train"
    script.write_text("import sys\nfrom mogo_diffusion.train import main\nsys.exit(main())\n")
    result = run_without(tmp_path, ("accelerate",), str(script), "--check")
    assert result.returncode == 1
    assert result.stderr == DIFFUSION + "\n"


def test_importing_mogo_diffusion_without_the_extra_raises_an_import_error(tmp_path):
    code = (
        "import mogo\n"  # mogo itself needs only torch, numpy and scipy
        "try:\n    import mogo_diffusion.config\n"
        "except ImportError as error:\n    print(type(error).__name__, error.name, error)\n"
    )
    result = run_without(tmp_path, EXTRAS["diffusion"][0], "-c", code)
    assert result.returncode == 0, result.stderr
    missing = ", ".join(EXTRAS["diffusion"][0])
    expected = f"mogo_diffusion needs the diffusion extra (missing: {missing}): pip install 'mogo[diffusion]'"
    assert result.stdout == f"MissingExtraError diffusers {expected}\n"


def test_qpth_and_torchjd_name_their_install_commands(tmp_path):
    code = (
        "import torch, mogo\n"
        "for build in (lambda: mogo.min_norm(torch.eye(2, dtype=torch.float64), method='qpth'),\n"
        "              lambda: mogo.TorchJDWeighting(print)):\n"
        "    try:\n        build()\n"
        "    except ImportError as error:\n        print(error)\n"
    )
    result = run_without(tmp_path, ("qpth", "torchjd"), "-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "method='qpth' needs the qp extra (missing: qpth): pip install 'mogo[qp]'",
        "mogo.TorchJDWeighting needs the torchjd package (missing: torchjd): pip install torchjd",
    ]


def test_the_ocr_reward_and_the_tensorboard_tracker_name_their_extras(tmp_path):
    code = (
        "from mogo_diffusion.rewards import make_reward\n"
        "from mogo_diffusion.train import _trackers\n"
        "for build in (lambda: make_reward('ocr'), lambda: _trackers(['tensorboard'])):\n"
        "    try:\n        build()\n"
        "    except (ImportError, ValueError) as error:\n        print(error)\n"
    )
    result = run_without(tmp_path, ("cv2", "rapidocr_onnxruntime", "tensorboard"), "-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "the 'ocr' reward needs the ocr extra (missing: rapidocr_onnxruntime, cv2): pip install 'mogo[ocr]'",
        "train.log_with: tracker 'tensorboard' needs the tracking extra (missing: tensorboard): "
        "pip install 'mogo[tracking]'",
    ]


def test_every_optional_dependency_group_of_the_package_is_known():
    """Each extra of pyproject.toml (but docs and dev, which no code imports) has its modules."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras) - {"docs", "dev"} == set(EXTRAS) - {"torchjd"}
    for extra in set(extras) - {"docs", "dev"}:
        assert len(EXTRAS[extra][0]) == len(extras[extra]), extra  # one module per requirement
        assert EXTRAS[extra][1] == f"pip install 'mogo[{extra}]'"


def test_require_passes_when_everything_is_installed_and_names_a_blocked_module(monkeypatch):
    for extra in EXTRAS:
        require("this test", extra)  # the dev environment has every extra
    monkeypatch.setitem(sys.modules, "qpth", None)  # Python's own way to make an import fail
    message = r"^x needs the qp extra \(missing: qpth\): pip install 'mogo\[qp\]'$"
    with pytest.raises(MissingExtraError, match=message):
        require("x", "qp")
