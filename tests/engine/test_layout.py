"""The engine's packages import only along the arrows of docs/architecture.md:

    platform -> engine (its public face) -> engine.serve -> engine.core -> engine.parallel -> engine.lora
        -> engine.model -> engine.memory -> engine.errors; kernels below them all; engine.tools on top, imported by
        nothing at run time.

Read from the source (every `import` and `from ... import`, TYPE_CHECKING blocks included: a type is a dependency
too), so a new module that imports against the arrows fails here, naming the module and the import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / "engine"
PLATFORM = REPO / "platform"

# Lower levels never import higher ones; a package may import itself and anything below it.
LEVELS = {
    "loraplex.kernels": 0,
    "loraplex.engine.errors": 1,
    "loraplex.engine.memory": 2,
    "loraplex.engine.model": 3,
    "loraplex.engine.lora": 4,
    "loraplex.engine.parallel": 5,
    "loraplex.engine.core": 6,
    "loraplex.engine.serve": 7,
    "loraplex.engine.tools": 8,
}
# What the platform may name: the engine's public faces, never the modules inside its packages.
PUBLIC = ("loraplex.engine", "loraplex.engine.lora", "loraplex.engine.serve")
# The one upward import: `loraplex engine demo-model|demo-adapter` are the commands that run the tools.
COMMANDS = "loraplex.engine.serve.cli"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    name = ".".join(("loraplex", *parts))
    return name.removesuffix(".__init__")


def package_of(module: str) -> str | None:
    """The engine package (a key of LEVELS) a module belongs to; None for the engine's own face."""
    for package in sorted(LEVELS, key=len, reverse=True):
        if module == package or module.startswith(package + "."):
            return package
    return None


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every loraplex import in the file."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [(line, name) for line, name in found if name.startswith("loraplex.")]


def engine_violations() -> list[str]:
    problems = []
    for path in sorted(ENGINE.rglob("*.py")):
        module = module_name(path)
        own = package_of(module)
        if own is None:
            continue  # loraplex.engine itself: the public face, which names what lies inside
        for line, target in imports(path):
            other = package_of(target)
            if module == COMMANDS and other == "loraplex.engine.tools":
                continue
            if target == "loraplex.engine" or (other is not None and LEVELS[other] > LEVELS[own]):
                problems.append(f"{path.relative_to(REPO)}:{line}: {own} imports {target}")
    return problems


def platform_violations() -> list[str]:
    problems = []
    for path in sorted(PLATFORM.rglob("*.py")):
        for line, target in imports(path):
            if target.startswith("loraplex.engine") and target not in PUBLIC:
                problems.append(f"{path.relative_to(REPO)}:{line}: imports {target}, not a public face")
    return problems


def test_engine_packages_import_only_downwards() -> None:
    assert engine_violations() == []


def test_the_platform_imports_only_the_engines_public_faces() -> None:
    assert platform_violations() == []


def test_nothing_at_run_time_imports_the_tools() -> None:
    users = [
        f"{path.relative_to(REPO)}:{line}"
        for root in (ENGINE, PLATFORM)
        for path in sorted(root.rglob("*.py"))
        if package_of(module_name(path)) != "loraplex.engine.tools"
        for line, target in imports(path)
        if package_of(target) == "loraplex.engine.tools" and module_name(path) != COMMANDS
    ]
    assert users == []


def test_every_engine_package_says_what_it_may_import() -> None:
    for package in LEVELS:
        if not package.startswith("loraplex.engine.") or package == "loraplex.engine.errors":
            continue
        init = ENGINE / package.removeprefix("loraplex.engine.") / "__init__.py"
        docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in docstring, init


def test_the_check_catches_an_upward_import(tmp_path: Path) -> None:
    """The checks themselves: a memory module importing the core, and a platform module reaching inside."""
    assert package_of("loraplex.engine.memory.kv_cache") == "loraplex.engine.memory"
    assert LEVELS[package_of("loraplex.engine.core.request") or ""] > LEVELS["loraplex.engine.memory"]
    bad = tmp_path / "bad.py"
    bad.write_text("from loraplex.engine.core.request import Request\nimport loraplex.kernels.sgmv\n")
    assert [target for _, target in imports(bad)] == ["loraplex.engine.core.request", "loraplex.kernels.sgmv"]
