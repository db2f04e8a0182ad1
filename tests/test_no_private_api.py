"""mogo and mogo_diffusion use torch's public API only, and peft's private attributes in one place.

A private API changes or disappears in any release without notice, so no module may reach into
one: not ``torch._C``, not an underscored attribute of anything imported from torch
(``torch._foreach_lerp_``, ``torch.optim.Optimizer._patch_step_function``), not an underscored
torch module. Where a private call is the only way, it is wrapped in one module, whose tests
fail loudly when the library changes: for peft's adapter switches that module is
:data:`PEFT_WRAPPER`.

The source is read (``ast``), not imported. What a subclass of a torch class defines for its
base class's public methods (the hook dicts that ``torch.optim.Optimizer.register_*_hook``
fills, on ``self``) is its own attribute, not a private call.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mogo", "mogo_diffusion")

#: Private names of torch's that reach us on objects, not through a ``torch`` name.
TORCH_PRIVATE_ATTRIBUTES = frozenset({"_patch_step_function", "_profiler_enabled"})

#: peft's private adapter switches, and the one module that may hold them.
PEFT_PRIVATE_ATTRIBUTES = frozenset({"_active_adapter", "_disable_adapters"})
PEFT_WRAPPER = "mogo_diffusion/peft_adapters.py"

#: Uses of them outside PEFT_WRAPPER known today, to move there (none left): file -> attributes.
KNOWN_PEFT_USES: dict[str, set[str]] = {}


def sources() -> Iterator[tuple[str, ast.Module, str]]:
    """``(path from the root, syntax tree, text)`` of every module of the packages."""
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            yield path.relative_to(ROOT).as_posix(), ast.parse(text, filename=str(path)), text


def private(name: str) -> bool:
    """An underscored name that is not a dunder (``__version__`` is public)."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def torch_names(tree: ast.Module) -> set[str]:
    """The names a module binds to torch or to anything imported from it."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {
                (a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "torch"
            }
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names |= {a.asname or a.name for a in node.names}
    return names


def chain(node: ast.Attribute) -> tuple[str | None, list[str]]:
    """The root name of ``a.b.c`` (None when the root is no name) and its attributes."""
    attributes = []
    while isinstance(node, ast.Attribute):
        attributes.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), attributes[::-1]


def torch_private_uses(tree: ast.Module) -> list[str]:
    """Every private torch API a module uses, as ``"line: what"``."""
    roots = torch_names(tree)
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {
                f"{node.lineno}: import {a.name}"
                for a in node.names
                if a.name.split(".")[0] == "torch" and any(map(private, a.name.split(".")))
            }
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(map(private, [*node.module.split("."), *(a.name for a in node.names)])):
                found.add(f"{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Attribute):
            root, attributes = chain(node)
            if id(node) not in inner and root in roots and any(map(private, attributes)):
                found.add(f"{node.lineno}: {'.'.join([root, *attributes])}")  # the whole chain, once
            if node.attr in TORCH_PRIVATE_ATTRIBUTES:
                found.add(f"{node.lineno}: .{node.attr}")
    return sorted(found)


def peft_private_uses(tree: ast.Module) -> set[str]:
    """The private peft attributes a module reads or writes."""
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in PEFT_PRIVATE_ATTRIBUTES
    }


def test_no_module_uses_a_private_torch_api():
    found = {path: uses for path, tree, _ in sources() if (uses := torch_private_uses(tree))}
    assert found == {}, f"private torch API in use (use the public route): {found}"


def test_torch_c_is_not_even_mentioned():
    """Not in code, comments or docstrings: a mention invites the next use."""
    mentions = [path for path, _, text in sources() if "torch._C" in text]
    assert mentions == []


def test_peft_private_attributes_stay_in_the_wrapper_module():
    found = {
        path: uses
        for path, tree, _ in sources()
        if path != PEFT_WRAPPER and (uses := peft_private_uses(tree))
    }
    assert found == KNOWN_PEFT_USES, (
        f"peft's private attributes belong in {PEFT_WRAPPER}; found {found}, known {KNOWN_PEFT_USES} "
        "(a known use that has moved there comes off KNOWN_PEFT_USES)"
    )


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (
            "import torch\ntorch._C._autograd._profiler_enabled()",
            ["2: ._profiler_enabled", "2: torch._C._autograd._profiler_enabled"],
        ),
        ("import torch as t\nt._foreach_lerp_(a, b, 0.5)", ["2: t._foreach_lerp_"]),
        (
            "from torch import optim\noptim.Optimizer._patch_step_function(o)",
            ["2: ._patch_step_function", "2: optim.Optimizer._patch_step_function"],
        ),
        ("from torch._C import _autograd", ["1: from torch._C import _autograd"]),
        ("import torch._dynamo", ["1: import torch._dynamo"]),
        ("self._patch_step_function()", ["1: ._patch_step_function"]),
        ("import torch\ntorch.optim.Optimizer.profile_hook_step(f)\ntorch.__version__", []),
        ("self._optimizer_step_pre_hooks = {}\nother._private = 1\nimport mogo._extras", []),  # not torch's
    ],
)
def test_the_scan_finds_what_it_is_meant_to(code, expected):
    """The scan itself, on snippets: it would fail on the code this project replaced."""
    assert torch_private_uses(ast.parse(code)) == sorted(expected)
