"""The native operators' CPU levels (kernels/native.py, decision 0050): the dispatch picks the best level a CPU's
features allow (features faked here), /proc/cpuinfo is read as Linux writes it, and the image's exact build recipe
(the Dockerfile's native stage) builds two levels without -march=native, each of which loads where forced and agrees
with the torch reference (the kernels' native tests, run against it)."""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.kernels import native

REPO = Path(__file__).resolve().parents[2]
ZEN4 = [
    *("fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"),
    *("abm", "xsave", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16"),
    "avx512ifma",
]
SKYLAKE_SP = [flag for flag in ZEN4 if flag not in ("avx512_vnni", "avx512_bf16", "avx512ifma")]
HASWELL = [flag for flag in SKYLAKE_SP if not flag.startswith("avx512")]
NEHALEM = ["fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("arch", "features", "expected"),
    [
        ("x86_64", ZEN4, ["x86-64-v4-bf16", "x86-64-v4", "x86-64-v3"]),
        ("x86_64", [*ZEN4, "amx_tile", "amx_int8", "amx_bf16"], ["x86-64-v4-bf16", "x86-64-v4", "x86-64-v3"]),
        ("x86_64", SKYLAKE_SP, ["x86-64-v4", "x86-64-v3"]),
        ("x86_64", HASWELL, ["x86-64-v3"]),
        ("x86_64", [f for f in HASWELL if f != "fma"], []),  # AVX2 without FMA: no level, the torch paths
        ("x86_64", NEHALEM, []),
        ("aarch64", ["fp", "asimd", "evtstrm", "sve"], ["armv8-a"]),
        ("aarch64", ZEN4, []),  # another architecture's flags never pick an x86 library
    ],
)
def test_the_dispatch_takes_the_best_level_the_cpu_has(arch: str, features: list[str], expected: list[str]) -> None:
    assert [level.name for level in native.levels_for(arch, features)] == expected


@pytest.mark.unit
def test_cpu_features_are_read_as_linux_writes_them(tmp_path: Path) -> None:
    x86 = tmp_path / "x86"
    x86.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {' '.join(ZEN4)}\n\nprocessor\t: 1\n")
    assert native.cpu_features(x86) == frozenset(ZEN4)
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes sve\nCPU implementer\t: 0x41\n")
    assert native.cpu_features(arm) == {"fp", "asimd", "evtstrm", "aes", "sve"}
    assert native.cpu_features(tmp_path / "missing") == frozenset()
    assert native.cpu_vendor(x86) == "AuthenticAMD"
    assert native.cpu_vendor(arm) == "" and native.cpu_vendor(tmp_path / "missing") == ""
    # This machine: what the test session's build chose is a level this CPU runs.
    here = native.levels_for(platform.machine(), native.cpu_features())
    status = native.status()
    assert status.level is None or status.level in [level.name for level in here]


def _recipe() -> list[str]:
    """The Dockerfile native stage's build command, as a list of arguments."""
    stages = re.split(r"^FROM ", (REPO / "Dockerfile").read_text(), flags=re.MULTILINE)
    (stage,) = [s for s in stages if s.split("\n", 1)[0].strip().endswith("AS native")]
    assert "g++" in stage  # the compiler lives in the build stage only
    (command,) = [line.removeprefix("RUN ") for line in stage.splitlines() if "kernels/native.py" in line]
    return shlex.split(command)


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64", reason="builds the x86-64 levels")
def test_the_image_recipe_builds_each_level_without_march_native(tmp_path: Path) -> None:
    recipe = _recipe()
    dockerfile = (REPO / "Dockerfile").read_text()
    dest = recipe[recipe.index("--dest") + 1]
    assert f"COPY --from=native {dest} {dest}" in dockerfile and f"LORAPLEX_NATIVE_DIR={dest}" in dockerfile
    assert recipe[recipe.index("--levels") + 1] == "all"
    # The same command, on the repository's sources, for two levels and into a folder of the test's own.
    command = [sys.executable if arg == "python" else arg for arg in recipe]
    command[command.index("/src/kernels/native.py")] = str(REPO / "kernels" / "native.py")
    command[command.index("--levels") + 1] = "x86-64-v3,x86-64-v4"
    command[command.index("--dest") + 1] = str(tmp_path)
    built = subprocess.run([*command, "-v"], capture_output=True, text=True, check=True, timeout=600)
    compiles = [line for line in built.stdout.splitlines() if " -c " in line]
    assert len(compiles) == 4 and not any("-march=native" in line for line in compiles), built.stdout
    assert sum("-march=x86-64-v3" in line for line in compiles) == sum("-march=x86-64-v4" in line for line in compiles)
    names = sorted(path.name for path in tmp_path.glob("*.so"))
    assert names == sorted(native.library_name(native.BY_NAME[n]) for n in ("x86-64-v3", "x86-64-v4")), names

    def run(code_or_tests: list[str], **env: str) -> subprocess.CompletedProcess[str]:
        environment = {**os.environ, "LORAPLEX_NATIVE_DIR": str(tmp_path), "LORAPLEX_NATIVE_BUILD": "0", **env}
        return subprocess.run(
            [sys.executable, *code_or_tests], capture_output=True, text=True, env=environment, timeout=600, cwd=REPO
        )

    probe = ["-c", "from loraplex.kernels import native; print(native.status().level)"]
    here = [level.name for level in native.levels_for("x86_64", native.cpu_features())]
    best = next(name for name in here if name in ("x86-64-v4", "x86-64-v3"))  # of the two built
    assert run(probe).stdout.strip() == best
    kernels = ["tests/kernels/test_quant.py", "tests/kernels/test_paged_attention.py", "tests/kernels/test_sgmv.py"]
    for level in ("x86-64-v3", "x86-64-v4"):
        if level not in here:
            continue  # this CPU cannot run it
        assert run(probe, LORAPLEX_NATIVE_LEVEL=level).stdout.strip() == level
        tested = run(
            ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "native", *kernels], LORAPLEX_NATIVE_LEVEL=level
        )
        assert tested.returncode == 0, tested.stdout[-3000:]
        assert re.search(r"\b(\d+) passed\b", tested.stdout) and " skipped" not in tested.stdout.splitlines()[-1]
