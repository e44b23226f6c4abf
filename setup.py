"""Maps the three code folders (and the migrations) into the `loraplex` namespace.

platform/ has no __init__.py on purpose: a regular package named `platform` would shadow the standard library
for anyone who runs Python from the repository root. Sub-packages are discovered here because pyproject.toml
cannot discover the sub-packages of a remapped folder.
"""

from pathlib import Path

from setuptools import find_namespace_packages, setup

FOLDERS = {"platform": "platform", "engine": "engine", "kernels": "kernels", "migrations": "migrations"}
HERE = Path(__file__).parent

packages: list[str] = []
package_dir: dict[str, str] = {}
for name, folder in FOLDERS.items():
    top = f"loraplex.{name}"
    packages.append(top)
    package_dir[top] = folder
    for sub in find_namespace_packages(where=str(HERE / folder), exclude=["*__pycache__*", "csrc", "_native"]):
        packages.append(f"{top}.{sub}")

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={
        "loraplex.platform": ["py.typed", "**/*.html", "**/*.css", "**/*.js"],
        "loraplex.engine": ["py.typed"],
        "loraplex.engine.tools": ["*.txt"],
        # The native sources are built on the target by `python -m loraplex.kernels.native`.
        "loraplex.kernels": ["py.typed", "csrc/*.cpp", "csrc/*.h"],
        "loraplex.migrations": ["script.py.mako", "versions/*.py"],
    },
    include_package_data=False,
)
