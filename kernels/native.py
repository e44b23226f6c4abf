"""loraplex's native CPU operators, compiled for a few CPU levels and chosen at load by the running CPU's features.

kernels/csrc/cpu_ops.cpp holds two operators of CPU decode, decode attention over the paged cache and the LoRA
segments of one fused projection (docs/decisions/0036-native-cpu-operators.md says why and what they measured);
kernels/csrc/quant_ops.cpp the int8 and int4 matmuls with 8-bit activations (decision 0039). They are compiled with
the C++ compiler torch's own extensions use, against the installed torch's headers, once per level (`LEVELS`:
x86-64 v3 with AVX2 and FMA, v4 with AVX-512, v4 with VNNI and BF16 too, ARMv8), never for `-march=native`: a
library built on one machine runs on any machine of its level (decision 0050).

`status()` loads the best level the CPU has whose library it finds, in `$LORAPLEX_NATIVE_DIR` or else in the
package's `_native/` (what `make` and the image's build stage write) and the user's cache
(`~/.cache/loraplex/native`); when none is there it builds the CPU's best level into the cache on first use (a pip
install with a compiler; `LORAPLEX_NATIVE_BUILD=0` says not to), registers `torch.ops.loraplex_cpu.*`, and says
which path serves. Without a library (no compiler, a CPU below every level) or with `LORAPLEX_NATIVE=0` nothing is
loaded and callers take the torch paths, which define the semantics and remain the reference the tests compare
against.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import platform
import subprocess
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "cpu_ops.cpp", CSRC / "quant_ops.cpp")
PACKAGE_DIR = Path(__file__).parent / "_native"
# Everything but the instruction set: -mtune=generic so that a library is tuned for no machine in particular.
COMMON_FLAGS = (
    "-std=c++20",
    "-O3",
    "-mtune=generic",
    "-fopenmp-simd",
    "-ffast-math",
    "-fno-finite-math-only",
    "-fno-reciprocal-math",
)
# libmvec: the vectorized expf that -ffast-math lets the softmax loops call.
_LINK = ["-lc10", "-ltorch_cpu", "-lmvec"]


@dataclass(frozen=True)
class Level:
    """One instruction-set level a library is built for: its compiler flags and the CPU features (as Linux names
    them in /proc/cpuinfo) a CPU must have to run it."""

    name: str
    arch: str  # platform.machine() of the CPUs it is for
    flags: tuple[str, ...]
    needs: frozenset[str]

    def runs_on(self, arch: str, features: Iterable[str]) -> bool:
        return arch == self.arch and self.needs <= set(features)


_V3 = frozenset({"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm", "xsave"})  # abm: lzcnt
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# Best first within an architecture.
LEVELS = (
    # Cooper Lake, Sapphire Rapids and later Xeons, AMD Zen 4 and later.
    Level("x86-64-v4-bf16", "x86_64", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
          _V4 | {"avx512_vnni", "avx512_bf16"}),
    Level("x86-64-v4", "x86_64", ("-march=x86-64-v4",), _V4),  # Skylake-SP to Ice Lake
    Level("x86-64-v3", "x86_64", ("-march=x86-64-v3",), _V3),  # Haswell and later, Zen 1-3
    Level("armv8-a", "aarch64", ("-march=armv8-a",), frozenset({"asimd"})),  # NEON: every ARMv8 server
)  # fmt: skip
BY_NAME = {level.name: level for level in LEVELS}


def _cpuinfo_field(cpuinfo: Path, keys: tuple[str, ...]) -> str | None:
    """The value of the first line of /proc/cpuinfo whose key is one of `keys`; None where there is none."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keys:
            return value
    return None


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The running CPU's feature flags (x86 `flags`, ARM `Features`); empty where /proc/cpuinfo is not."""
    return frozenset((_cpuinfo_field(cpuinfo, ("flags", "Features")) or "").split())


def cpu_vendor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The running CPU's vendor as /proc/cpuinfo names it ("GenuineIntel", "AuthenticAMD"); "" where it does not."""
    return (_cpuinfo_field(cpuinfo, ("vendor_id",)) or "").strip()


def levels_for(arch: str, features: Iterable[str]) -> list[Level]:
    """The levels a CPU of `arch` with `features` runs, best first."""
    features = set(features)
    return [level for level in LEVELS if level.runs_on(arch, features)]


def _tag(level: Level) -> str:
    """What a library depends on: its source, its flags and the torch it was built against."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.glob("*.[ch]*")):
        digest.update(path.read_bytes())
    digest.update(" ".join([*COMMON_FLAGS, *level.flags, "link-apart", *_LINK]).encode())
    digest.update(torch.__version__.encode())
    return digest.hexdigest()[:16]


def library_name(level: Level) -> str:
    return f"loraplex_cpu_{level.name}_{_tag(level)}.so"


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "loraplex" / "native"


def search_dirs() -> list[Path]:
    """Where libraries are looked for: $LORAPLEX_NATIVE_DIR alone when set, else the package's and the cache."""
    configured = os.environ.get("LORAPLEX_NATIVE_DIR")
    return [Path(configured)] if configured else [PACKAGE_DIR, cache_dir()]


def build(level: Level, dest: Path, *, verbose: bool = False) -> Path:
    """Compile the sources for `level` into `dest` unless its library is already there; returns its path."""
    from torch.utils.cpp_extension import include_paths, library_paths

    target = dest / library_name(level)
    if target.exists():
        return target
    dest.mkdir(parents=True, exist_ok=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compiler = os.environ.get("CXX", "g++")
    scratch = f"{os.getpid()}"  # two processes building at once write files of their own
    objects = [target.with_name(f"{target.stem}_{source.stem}.{scratch}.o") for source in SOURCES]
    # Compiled with the flags, linked without them: gcc links crtfastmath.o into a library linked with -ffast-math,
    # and that object turns on flush-to-zero for the whole process that loads it (every float op, not only ours).
    commands = [
        [
            compiler, "-c", "-fPIC", *COMMON_FLAGS, *level.flags, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{p}" for p in include_paths()), f"-I{sysconfig.get_paths()['include']}", str(source), "-o", str(obj),
        ]
        for source, obj in zip(SOURCES, objects, strict=True)
    ]  # fmt: skip
    partial = target.with_suffix(f".{scratch}.tmp")
    link = [compiler, "-shared", "-fPIC", *(str(obj) for obj in objects), "-o", str(partial)]
    link += [*(f"-L{p}" for p in library_paths()), *_LINK, *(f"-Wl,-rpath,{p}" for p in library_paths())]
    commands.append(link)
    try:
        for command in commands:
            if verbose:
                print(" ".join(command))
            subprocess.run(command, check=True)
        partial.rename(target)  # atomic: a concurrent loader never sees half a library
    finally:
        for path in (*objects, partial):
            path.unlink(missing_ok=True)
    return target


@dataclass(frozen=True)
class Status:
    """Which path the native operators take in this process: `level` and `library` when loaded, else `reason`."""

    level: str | None
    library: str | None
    reason: str

    @property
    def path(self) -> str:
        return f"native/{self.level}" if self.level is not None else "torch"  # no space: a label value

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "level": self.level, "library": self.library, "reason": self.reason}


def _candidates() -> tuple[list[Level], str | None]:
    """The levels to look for, best first, or why there are none."""
    levels = levels_for(platform.machine(), cpu_features())
    forced = os.environ.get("LORAPLEX_NATIVE_LEVEL")
    if forced:
        if forced not in BY_NAME:
            return [], f"LORAPLEX_NATIVE_LEVEL={forced} is no level (levels: {', '.join(BY_NAME)})"
        if BY_NAME[forced] not in levels:
            return [], f"LORAPLEX_NATIVE_LEVEL={forced}: this CPU does not have what it needs"
        return [BY_NAME[forced]], None
    if not levels:
        return [], f"this CPU ({platform.machine()}) has none of the levels the operators are built for"
    return levels, None


@cache
def status() -> Status:
    """Load the best library for this CPU (building it into the cache on first use) and say what was loaded."""
    if os.environ.get("LORAPLEX_NATIVE", "1") == "0":
        return Status(None, None, "LORAPLEX_NATIVE=0")
    levels, refused = _candidates()
    if refused is not None:
        return Status(None, None, refused)
    found = next(
        ((d / library_name(lv), lv) for lv in levels for d in search_dirs() if (d / library_name(lv)).exists()), None
    )
    reason = "found"
    if found is None:
        if os.environ.get("LORAPLEX_NATIVE_BUILD", "1") == "0":
            return Status(None, None, f"no library for {levels[0].name} (and LORAPLEX_NATIVE_BUILD=0)")
        dest = search_dirs()[-1]
        try:
            logger.info("building loraplex's native CPU operators for %s into %s (once)", levels[0].name, dest)
            found = (build(levels[0], dest), levels[0])
            reason = "built on first use"
        except (OSError, subprocess.CalledProcessError) as exc:
            message = f"no library for {levels[0].name}, and building one failed ({exc})"
            logger.warning("loraplex's native CPU operators are not loaded: %s; the torch paths serve", message)
            return Status(None, None, message)
    path, level = found
    torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]
    return Status(level.name, str(path), reason)


def load() -> bool:
    """Whether torch.ops.loraplex_cpu is registered (`status()` loads it)."""
    return status().level is not None


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loraplex.kernels.native", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--levels",
        default="best",
        help="'best' (this CPU's best level, the default), 'all' (every level of this architecture: an image's "
        f"build stage), or names separated by commas ({', '.join(BY_NAME)})",
    )
    parser.add_argument(
        "--dest", type=Path, default=None, help="folder to write into ($LORAPLEX_NATIVE_DIR, else the package's)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print the compiler's command lines")
    return parser.parse_args(argv)


def _chosen(spec: str) -> list[Level]:
    arch = platform.machine()
    if spec == "best":
        return levels_for(arch, cpu_features())[:1]
    if spec == "all":
        return [level for level in LEVELS if level.arch == arch]
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown level {', '.join(unknown)}: the levels are {', '.join(BY_NAME)}")
    return [BY_NAME[name] for name in names]


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m loraplex.kernels.native`: build libraries; a machine without a compiler keeps the torch paths."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    configured = os.environ.get("LORAPLEX_NATIVE_DIR")
    dest = args.dest or (Path(configured) if configured else PACKAGE_DIR)
    levels = _chosen(args.levels)
    if not levels:
        print(
            f"warning: this CPU ({platform.machine()}) has no level to build for; the torch paths serve",
            file=sys.stderr,
        )
        return
    for level in levels:
        try:
            path = build(level, dest, verbose=args.verbose)
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"warning: loraplex's native CPU operators were not built for {level.name} ({exc})", file=sys.stderr)
            continue
        print(f"built {path}")


if __name__ == "__main__":
    main()
