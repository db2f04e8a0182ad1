"""Without an optional dependency, each feature that needs it fails with one line naming the install
command. Each test runs Python for real in an environment that lacks the packages: a folder of
symlinks to what ``pip install mogo`` installs (torch, numpy, scipy and their requirements), or to
the installed site-packages minus some packages, run with ``-S -E -s`` so that the real
site-packages is not on the path."""

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


def _run_in(tmp_path: Path, keep, args: tuple[str, ...]) -> subprocess.CompletedProcess:
    """Run ``python -S -E -s *args`` in a folder of symlinks to the site-packages entries that
    ``keep(top-level name, normalised distribution name or None)`` accepts, and this checkout's
    packages; the folder is the working directory, first on ``sys.path``."""
    for entry in SITE.iterdir():
        stem = entry.name.split(".")[0]
        dist = _normal(entry.name.split("-")[0]) if entry.name.endswith("-info") else None
        if stem not in ("mogo", "mogo_diffusion") and keep(stem, dist):
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


def run_without(tmp_path: Path, modules: tuple[str, ...], *args: str) -> subprocess.CompletedProcess:
    """``python *args`` where everything installed here is, but ``modules`` (and their dist-info)."""
    dists = set().union(*(_dist_infos(m) for m in modules))
    return _run_in(tmp_path, lambda stem, dist: stem not in modules and dist not in dists, args)


def _requirements(names: tuple[str, ...]) -> set[str]:
    """The normalised names of distributions ``names`` and everything they require (no extras)."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = _normal(todo.pop())
        if name not in seen:
            seen.add(name)
            for line in importlib.metadata.distribution(name).requires or []:
                requirement = Requirement(line)
                if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                    todo.append(requirement.name)
    return seen


def run_bare(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``python *args`` where only what ``pip install mogo`` installs is: torch, numpy, scipy and
    their requirements."""
    dists = _requirements(("torch", "numpy", "scipy"))
    tops = {
        top
        for top, of in importlib.metadata.packages_distributions().items()
        if dists & set(map(_normal, of))
    }
    return _run_in(tmp_path, lambda stem, dist: stem in tops or dist in dists, args)


DIFFUSION = (
    f"mogo_diffusion needs the diffusion extra (missing: {', '.join(EXTRAS['diffusion'][0])}): "
    "pip install 'mogo[diffusion]'"
)


@pytest.mark.spawns
def test_the_training_command_after_pip_install_mogo_prints_one_line(tmp_path):
    result = run_bare(tmp_path, "-m", "mogo_diffusion.train", "--check")
    assert result.returncode == 1
    assert result.stderr == DIFFUSION + "\n"


@pytest.mark.spawns
def test_the_console_script_after_pip_install_mogo_prints_one_line(tmp_path):
    """``mogo-train`` as pip writes it: a script of that name that imports and calls ``main``."""
    script = tmp_path / "mogo-train"
    script.write_text("import sys\nfrom mogo_diffusion.train import main\nsys.exit(main())\n")
    result = run_bare(tmp_path, str(script), "--check")
    assert result.returncode == 1
    assert result.stderr == DIFFUSION + "\n"


@pytest.mark.spawns
def test_importing_mogo_diffusion_after_pip_install_mogo_raises_an_import_error(tmp_path):
    code = (
        "import mogo\n"  # mogo itself needs only torch, numpy and scipy
        "try:\n    import mogo_diffusion.config\n"
        "except ImportError as error:\n    print(type(error).__name__, error.name, error)\n"
    )
    result = run_bare(tmp_path, "-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"MissingExtraError diffusers {DIFFUSION}\n"


@pytest.mark.spawns
def test_qpth_and_torchjd_after_pip_install_mogo_name_their_install_commands(tmp_path):
    code = (
        "import torch, mogo\n"
        "for build in (lambda: mogo.min_norm(torch.eye(2, dtype=torch.float64), method='qpth'),\n"
        "              lambda: mogo.TorchJDWeighting(print)):\n"
        "    try:\n        build()\n"
        "    except ImportError as error:\n        print(error)\n"
    )
    result = run_bare(tmp_path, "-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "method='qpth' needs the qp extra (missing: qpth): pip install 'mogo[qp]'",
        "mogo.TorchJDWeighting needs the torchjd package (missing: torchjd): pip install torchjd",
    ]


@pytest.mark.spawns
def test_the_ocr_reward_and_the_tensorboard_tracker_name_their_extras(tmp_path):
    code = (
        "from mogo_diffusion.rewards import make_reward\n"
        "from mogo_diffusion.checks import check_trackers\n"
        "for build in (lambda: make_reward('ocr'), lambda: check_trackers(['tensorboard'])):\n"
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
