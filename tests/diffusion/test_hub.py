"""Where weights come from: mogo_diffusion.hub, the one place that tells a path from a hub id."""

from __future__ import annotations

import ast
import os
import pickle
import re
import shlex
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from mogo_diffusion.hub import (
    CONFIG_FILES,
    HUB_ID,
    Source,
    checkpoint_file,
    download_command,
    download_hint,
    hub_file,
    is_hub_id,
    loading,
    offline,
    read_state_dict,
    resolve,
)

ROOT = Path(__file__).resolve().parents[2]
PART = st.text("abcXYZ019_.-", min_size=1, max_size=8)
WORD = st.text("abcdefgh0123456789_.-*", min_size=1, max_size=10)


# What is a hub id ---------------------------------------------------------------------------------


@given(PART, PART)
def test_org_slash_name_is_a_hub_id_when_the_org_starts_alphanumeric(org, name):
    assert is_hub_id(f"{org}/{name}") == org[0].isalnum()


@given(st.text(max_size=20))
def test_a_hub_id_has_exactly_one_slash_between_two_non_empty_parts(text):
    if is_hub_id(text):
        org, name = text.split("/")
        assert org
        assert name
        assert org[0].isalnum()
        assert not any(c.isspace() for c in text)


def test_a_path_object_or_a_non_string_is_never_a_hub_id():
    assert is_hub_id("org/name")
    assert not is_hub_id(Path("org/name"))
    assert not is_hub_id(None)
    assert HUB_ID.fullmatch("org/name.v2")


# resolve ------------------------------------------------------------------------------------------


@given(st.text("ab/._- ~", max_size=12))
def test_a_reference_that_is_no_path_resolves_to_the_hub_exactly_when_it_is_a_hub_id(reference):
    if os.path.exists(os.path.expanduser(reference or ".")) or not reference:
        return  # an existing path is local whatever its form
    if is_hub_id(reference):
        assert resolve(reference, "model") == Source(reference, False)
    else:
        with pytest.raises(
            FileNotFoundError, match=r"^model .* does not exist \(nor is it a hub id 'org/name'\)"
        ):
            resolve(reference, "model")


def test_an_existing_path_is_local_even_when_it_reads_as_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").write_text("x")
    assert resolve("org/name", "checkpoint") == Source("org/name", True)
    assert resolve(Path("org"), "model", directory=True) == Source("org", True)


def test_resolve_names_what_and_the_path_in_its_errors(tmp_path, monkeypatch):
    file = tmp_path / "weights.bin"
    file.write_bytes(b"")
    with pytest.raises(
        NotADirectoryError, match=r"^detector path .*weights\.bin' is a file; expected a directory$"
    ):
        resolve(file, "detector", directory=True)
    with pytest.raises(
        ValueError, match=r"^revision='main' applies to hub ids; model directory .* is local$"
    ):
        resolve(tmp_path, "model", directory=True, revision="main")
    with pytest.raises(FileNotFoundError, match=r"^model directory .*missing' does not exist .*; get it$"):
        resolve(tmp_path / "missing", "model", directory=True, hint="get it")
    with pytest.raises(FileNotFoundError, match=r"^model 'org/name' does not exist"):
        resolve(Path("org/name"), "model")  # a path object is a path, never a hub id
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve("~/weights.bin", "checkpoint") == Source(str(file), True)
    assert resolve("org/name", "model", revision="v1") == Source("org/name", False)


def test_a_home_of_no_user_is_a_missing_path_wherever_weights_are_named():
    """``Path.expanduser`` raises RuntimeError on ``~user`` of no user; the loaders say what is missing."""
    from mogo_diffusion.rewards.clip import AestheticPredictor
    from mogo_diffusion.rewards.imagereward import ImageReward

    missing = "~no-such-user-of-mogo/weights"
    with pytest.raises(FileNotFoundError, match="no-such-user-of-mogo"):
        resolve(missing, "model")
    with pytest.raises(FileNotFoundError, match="no-such-user-of-mogo"):
        AestheticPredictor.from_file(missing)
    with pytest.raises(FileNotFoundError, match="no-such-user-of-mogo"):
        ImageReward(missing)


# offline ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("environment", [True, False])
def test_offline_is_local_files_only_or_else_hf_hub_offline(environment, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", environment)
    assert offline(None) is environment
    assert offline(True) is True
    assert offline(False) is False


# Download commands and loading errors -------------------------------------------------------------


@given(
    PART.map(lambda s: "o" + s),
    st.lists(WORD, max_size=3),
    st.lists(WORD, max_size=3),
    st.none() | WORD,
    st.none() | WORD,
)
def test_a_download_command_says_what_it_was_given(repo, files, include, revision, local_dir):
    words = shlex.split(
        download_command(repo, *files, include=include, revision=revision, local_dir=local_dir)
    )
    assert words[:3] == ["hf", "download", repo]
    rest = words[3:]
    assert rest[: len(files)] == files
    rest = rest[len(files) :]
    if include:
        assert rest[: len(include) + 1] == ["--include", *include]
        rest = rest[len(include) + 1 :]
    if revision:
        assert rest[:2] == ["--revision", revision]
        rest = rest[2:]
    assert rest == (["--local-dir", local_dir] if local_dir is not None else [])


def test_download_hint():
    assert download_hint("org/clip", include=CONFIG_FILES) == (
        'download it with `hf download org/clip --include "*.json" "*.txt" --local-dir DIR` and pass DIR'
    )


def test_loading_names_the_source_and_for_a_hub_id_where_and_how_to_get_it():
    local = pytest.raises(OSError, match=r"^could not load the vae from '/x': no config$")
    with local as info, loading("the vae", Source("/x", True), False):
        raise FileNotFoundError("no config")
    assert isinstance(info.value.__cause__, FileNotFoundError)
    cached = pytest.raises(
        OSError, match=r"^could not load HPS checkpoint 'org/hps' from the local hub cache"
    )
    with cached as info, loading("HPS checkpoint", Source("org/hps", False), True, "model.pt"):
        raise OSError("not cached")
    assert str(info.value) == (
        "could not load HPS checkpoint 'org/hps' from the local hub cache (offline: HF_HUB_OFFLINE or "
        "local_files_only); download it with `hf download org/hps model.pt --local-dir DIR` and pass DIR. "
        "(not cached)"
    )
    online = pytest.raises(
        OSError, match=r"from the hub; download it with `hf download org/x --local-dir DIR`"
    )
    with online, loading("model", Source("org/x", False), False):
        raise OSError("404")
    with pytest.raises(KeyError), loading("model", Source("org/x", False), False):  # not a loading error
        raise KeyError("x")


def test_an_uncached_hub_file_offline_names_the_file_and_the_command():
    with pytest.raises(OSError, match=r"HPS checkpoint w\.pt of 'mogo-test/none' from the local hub cache.*"
                       r"hf download mogo-test/none w\.pt --local-dir DIR"):  # fmt: skip
        hub_file("mogo-test/none", "w.pt", "HPS checkpoint", only_local=True)


# Checkpoint files ---------------------------------------------------------------------------------


def test_a_checkpoint_is_a_file_a_directory_holding_it_or_a_hub_repository(tmp_path):
    file = tmp_path / "w.pt"
    file.write_bytes(b"")
    found = [
        checkpoint_file(ref, "w.pt", "checkpoint", repo="org/w", only_local=True) for ref in (file, tmp_path)
    ]
    assert found == [file, file]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        FileNotFoundError, match=r"checkpoint .*empty/w\.pt' not found; .*hf download org/w w\.pt"
    ):
        checkpoint_file(empty, "w.pt", "checkpoint", repo="org/w", only_local=True)
    with pytest.raises(
        FileNotFoundError, match=r"checkpoint .*missing' does not exist .*hf download org/w w\.pt"
    ):
        checkpoint_file(tmp_path / "missing", "w.pt", "checkpoint", repo="org/w", only_local=True)
    with pytest.raises(OSError, match=r"checkpoint w\.pt of 'mogo-test/none' from the local hub cache"):
        checkpoint_file("mogo-test/none", "w.pt", "checkpoint", repo="org/w", only_local=True)


# State dicts --------------------------------------------------------------------------------------


def test_a_state_dict_reads_back_from_safetensors_and_from_a_torch_file(tmp_path):
    state = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1, 2], dtype=torch.int64)}
    save_file(state, tmp_path / "w.safetensors")
    torch.save(state, tmp_path / "w.pt")
    for name in ("w.safetensors", "w.pt"):
        read = read_state_dict(tmp_path / name)
        assert read.keys() == state.keys()
        assert all(torch.equal(read[k], state[k]) for k in state)


class _Code:
    def __reduce__(self):
        return (print, ("this ran",))


def test_a_state_dict_file_runs_no_code_and_bad_files_are_named(tmp_path, capsys):
    (tmp_path / "code.pt").write_bytes(pickle.dumps({"a": _Code()}, protocol=2))
    with pytest.raises(ValueError, match=r"could not read the state dict .*code\.pt'"):
        read_state_dict(tmp_path / "code.pt")
    assert "this ran" not in capsys.readouterr().out
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(ValueError, match=r"list\.pt' holds a list, not a state dict"):
        read_state_dict(tmp_path / "list.pt")
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match=r"could not read the state dict .*bad\.safetensors'"):
        read_state_dict(tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match=r"missing\.pt"):
        read_state_dict(tmp_path / "missing.pt")


# One place ----------------------------------------------------------------------------------------


def _trees() -> list[tuple[str, ast.Module]]:
    return [
        (path.relative_to(ROOT).as_posix(), ast.parse(path.read_text()))
        for path in sorted((ROOT / "mogo_diffusion").rglob("*.py"))
    ]


def _uses(tree: ast.Module) -> set[str]:
    """The names, attributes and string constants of a module's code (docstrings are strings too)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add(node.name.rsplit(".", 1)[-1])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)
    return found


@pytest.mark.parametrize("use", [HUB_ID.pattern, "HF_HUB_OFFLINE", "hf_hub_download"])
def test_the_hub_id_pattern_the_offline_switch_and_downloads_live_in_the_hub_module_alone(use):
    assert [path for path, tree in _trees() if use in _uses(tree)] == ["mogo_diffusion/hub.py"]


def test_no_module_imports_another_modules_private_names():
    """Shared helpers are public where they live (hps and imagereward once imported clip's)."""
    found = [
        f"{path}: {alias.name}"
        for path, tree in _trees()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mogo")
        for alias in node.names
        if re.match(r"_(?!_)", alias.name)
    ]
    assert found == []
