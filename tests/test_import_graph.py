"""The packages' imports form a DAG, and ``mogo_diffusion/train.py`` reads top-down in call order.

Both are read from the source (``ast``), so lazy imports inside functions count as much as those
at the top of a module: a circle closed by a lazy import is still a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mogo", "mogo_diffusion")


def package_modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Module name to file of every ``.py`` file of ``packages`` under ``root``."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of the other modules of ``modules``, wherever in the file they are
    (``from a import b`` names the module ``a.b`` when there is one, else ``a``)."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        names = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names += [f"{node.module}.{alias.name}" for alias in node.names]
        graph[module] = {found for name in names if (found := resolve(name)) not in (None, module)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle a depth-first walk of ``graph`` closes, as ``[a, b, ..., a]``."""
    found: list[list[str]] = []
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                found.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


def test_the_packages_import_no_circle():
    graph = import_graph(package_modules(ROOT, PACKAGES))
    assert "mogo_diffusion.train" in graph["mogo_diffusion.evaluate"]  # the walk sees lazy imports
    circles = [" -> ".join(circle) for circle in cycles(graph)]
    assert not circles, "import circles: " + "; ".join(circles)
    assert not any(target.startswith("mogo_diffusion") for target in graph["mogo"]), (
        "mogo imports mogo_diffusion"
    )


def test_a_circle_closed_by_a_lazy_import_is_found_and_named(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import f\n")
    (package / "b.py").write_text("import os\n\ndef f():\n    from pkg import c\n")
    (package / "c.py").write_text("def g():\n    import pkg.a\n")
    graph = import_graph(package_modules(tmp_path, ("pkg",)))
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    (package / "c.py").write_text("import pkg\n")
    assert cycles(import_graph(package_modules(tmp_path, ("pkg",)))) == []


# ---- train.py top-down ---------------------------------------------------------------------------


def upward_calls(path: Path, instances: frozenset[str]) -> list[str]:
    """The calls in ``path`` from a function or method to one of its module defined above it:
    ``name(...)`` of a module function, ``x.name(...)`` of a method with ``x`` in ``instances``
    (``self``, a variable holding one) or ``cls`` or a class's name, and ``cls(...)`` or a class
    called (its ``__init__``, where it defines one). Each as ``caller -> callee``."""
    tree = ast.parse(path.read_text())
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    methods = {item.name: item for cls in classes for item in cls.body if isinstance(item, ast.FunctionDef)}
    defined = {node.name: node for node in functions}
    inits = {
        cls.name: item for cls in classes for item in cls.body if getattr(item, "name", "") == "__init__"
    }
    owners = [(None, node) for node in functions]
    owners += [(cls.name, item) for cls in classes for item in cls.body if isinstance(item, ast.FunctionDef)]
    found = []
    for owner, caller in owners:
        for node in ast.walk(caller):
            if not isinstance(node, ast.Call):
                continue
            func, callee = node.func, None
            if isinstance(func, ast.Name) and func.id in defined:
                callee = defined[func.id]
            elif isinstance(func, ast.Name):
                callee = inits.get(owner if func.id == "cls" else func.id)
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                target = func.value.id
                if target in instances or target == "cls" or target in inits:
                    callee = methods.get(func.attr)
            if callee is not None and callee.lineno < caller.lineno:
                found.append(f"{caller.name} -> {callee.name}")
    return found


def test_train_py_reads_top_down_in_call_order():
    """Every step of a run is defined below the step that calls it (issue 41)."""
    path = ROOT / "mogo_diffusion" / "train.py"
    assert upward_calls(path, frozenset({"self", "trainer"})) == []


def test_an_upward_call_is_found(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "def helper():\n    pass\n\n"
        "def main():\n    helper()\n    T.build()\n\n"
        "class T:\n"
        "    def step(self):\n        pass\n\n"
        "    @classmethod\n    def build(cls):\n        return cls()\n\n"
        "    def __init__(self):\n        self.run()\n\n"
        "    def run(self):\n        self.step()\n"
    )
    assert upward_calls(path, frozenset({"self"})) == ["main -> helper", "run -> step"]
