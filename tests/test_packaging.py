"""The package layout keeps `import platform` the standard library, in the editable install and in a wheel.

platform/ is mapped to `loraplex.platform` and has no __init__.py (docs/decisions/0001-package-layout.md): a
regular package named `platform` would shadow the standard library for anyone who runs Python from the
repository root. These tests pin that down, and check that a built wheel carries every module, data file and
migration, because the editable install (an import hook that maps names onto the source folders) would hide a
file that setup.py forgot to ship.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
CODE_FOLDERS = ("platform", "engine", "kernels")
MAPPED_FOLDERS = (*CODE_FOLDERS, "migrations")
# What a wheel is built from: the Dockerfile copies the same set (tests/test_compose.py checks it).
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", *MAPPED_FOLDERS)
# Files of the source folders that must end up in the wheel, by folder; setup.py's package_data must match.
SHIPPED_PATTERNS: dict[str, tuple[str, ...]] = {
    "platform": ("*.py", "py.typed", "*.html", "*.css", "*.js"),
    "engine": ("*.py", "py.typed"),
    "kernels": ("*.py", "py.typed"),
    "migrations": ("*.py", "*.mako"),
}
STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()


def _under(path: str | os.PathLike[str], root: Path) -> bool:
    return Path(path).resolve().is_relative_to(root.resolve())


def _real_path_entries(module: ModuleType) -> list[str]:
    # The editable finder adds a placeholder string (not a folder) to a namespace package's __path__.
    return [entry for entry in module.__path__ if os.path.isdir(entry)]


def _shipped_files(source_root: Path) -> set[str]:
    """Wheel member names that the source folders under `source_root` must produce."""
    expected: set[str] = set()
    for folder, patterns in SHIPPED_PATTERNS.items():
        base = source_root / folder
        for pattern in patterns:
            for path in base.rglob(pattern):
                if "__pycache__" in path.parts or not path.is_file():
                    continue
                expected.add(f"loraplex/{folder}/{path.relative_to(base).as_posix()}")
    return expected


@pytest.mark.unit
def test_platform_folder_is_not_a_regular_package() -> None:
    assert not (REPO / "platform" / "__init__.py").exists(), (
        "platform/__init__.py would make `platform` shadow the standard library; see "
        "docs/decisions/0001-package-layout.md"
    )


@pytest.mark.unit
def test_editable_install_keeps_stdlib_platform_and_maps_code_folders() -> None:
    import platform

    assert platform.__file__ is not None
    assert _under(platform.__file__, STDLIB), f"`import platform` gave {platform.__file__}, not the stdlib"
    assert platform.python_version() == ".".join(map(str, sys.version_info[:3]))

    for folder in CODE_FOLDERS:
        module = importlib.import_module(f"loraplex.{folder}")
        entries = _real_path_entries(module)
        assert entries, f"loraplex.{folder} has no folder on its __path__: {list(module.__path__)}"
        assert all(Path(entry).resolve() == (REPO / folder).resolve() for entry in entries), (
            f"loraplex.{folder} comes from {entries}, not {REPO / folder}; reinstall with "
            "`pip install -e '.[dev,kernels]'`"
        )

    settings = importlib.import_module("loraplex.platform.settings")
    assert settings.__file__ is not None
    assert _under(settings.__file__, REPO / "platform")


# Runs under `python -S` so that no .pth file is processed: the editable install's finder stays off and only
# the wheel in TARGET can provide `loraplex`. TARGET goes first, ahead of the standard library, so a stray
# top-level `platform` in the wheel would win and be caught.
_WHEEL_PROBE = """
import json, sys
target, site_dirs = sys.argv[1], json.loads(sys.argv[2])
sys.path[:] = [target, *(p for p in sys.path if p), *site_dirs]
import platform
import importlib, sysconfig
mods = {n: importlib.import_module(n) for n in
        ("loraplex.platform", "loraplex.engine", "loraplex.kernels", "loraplex.migrations",
         "loraplex.platform.settings")}
print(json.dumps({
    "platform_file": platform.__file__,
    "python_version": platform.python_version(),
    "stdlib": sysconfig.get_paths()["stdlib"],
    "no_site": sys.flags.no_site,
    "editable_finders": [repr(f) for f in sys.meta_path if "editable" in repr(f).lower()],
    "paths": {n: list(m.__path__) for n, m in mods.items() if hasattr(m, "__path__")},
    "files": {n: m.__file__ for n, m in mods.items()},
}))
"""


@pytest.mark.slow
def test_wheel_ships_every_module_and_keeps_stdlib_platform(tmp_path: Path) -> None:
    # Build from a copy: an in-tree build reuses build/lib, where files deleted from the source stay and
    # would be shipped (and tests running at the same time would race on it).
    source = tmp_path / "src"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".mypy_cache")
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=ignore)
        else:
            shutil.copy2(REPO / name, source / name)
    for license_file in REPO.glob("LICEN[CS]E*"):
        shutil.copy2(license_file, source / license_file.name)

    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "PIP_"))}
    env |= {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    pip = [sys.executable, "-m", "pip", "--quiet"]
    dist = tmp_path / "dist"
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist), str(source)],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    (wheel,) = dist.glob("loraplex-*.whl")

    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    top_level = {name.split("/", 1)[0] for name in names}
    assert {entry for entry in top_level if not entry.endswith(".dist-info")} == {"loraplex"}, top_level
    assert "loraplex/platform/__init__.py" not in names
    missing = _shipped_files(source) - names
    assert not missing, f"the wheel lacks {sorted(missing)}: check setup.py's packages and package_data"
    for folder in CODE_FOLDERS:
        assert f"loraplex/{folder}/py.typed" in names

    target = tmp_path / "target"
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )

    site_dirs = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    probe = subprocess.run(
        [sys.executable, "-S", "-c", _WHEEL_PROBE, str(target), json.dumps(site_dirs)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert probe.returncode == 0, probe.stderr
    report = json.loads(probe.stdout)

    assert report["no_site"] == 1
    assert report["editable_finders"] == [], "the editable install leaked into the wheel check"
    assert _under(report["platform_file"], Path(report["stdlib"])), report["platform_file"]
    assert report["python_version"] == ".".join(map(str, sys.version_info[:3]))
    assert set(report["paths"]) == {f"loraplex.{folder}" for folder in MAPPED_FOLDERS}
    for name, entries in report["paths"].items():
        assert entries, f"{name} has an empty __path__"
        assert all(_under(entry, target) for entry in entries), f"{name} comes from {entries}, not the wheel"
    for name, file in report["files"].items():
        # A namespace package (loraplex.platform) has no __file__.
        assert file is None or _under(file, target), f"{name} comes from {file}, not the wheel"
    assert _under(report["files"]["loraplex.platform.settings"], target)
