"""loraplex's native CPU operators: built once at install time (`make` runs `python -m loraplex.kernels.native`),
loaded when present.

kernels/csrc/cpu_ops.cpp holds two operators of CPU decode, decode attention over the paged cache and the LoRA
segments of one fused projection (docs/decisions/0036-native-cpu-operators.md says why and what they measured);
kernels/csrc/quant_ops.cpp the int8 and int4 matmuls with 8-bit activations (decision 0039).
They are compiled here with the C++ compiler torch's own extensions use, against the installed torch's headers, into
`kernels/_native/` (or `$LORAPLEX_NATIVE_DIR`), and registered as `torch.ops.loraplex_cpu.*` when this module loads
them. Without a build (no compiler, a read-only install) or with `LORAPLEX_NATIVE=0` nothing is loaded and callers
take the torch paths, which define the semantics and remain the reference the tests compare against.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import sysconfig
from functools import cache
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "cpu_ops.cpp", CSRC / "quant_ops.cpp")
# The machine's own instruction set: the library is built where it runs (CI, a developer's machine, an image's
# build stage on the serving host's CPU kind). Override with LORAPLEX_NATIVE_CFLAGS, e.g. -march=x86-64-v3.
DEFAULT_CFLAGS = "-std=c++20 -O3 -march=native -fopenmp-simd -ffast-math -fno-finite-math-only -fno-reciprocal-math"


# libmvec: the vectorized expf that -ffast-math lets the softmax loops call.
_LINK = ["-lc10", "-ltorch_cpu", "-lmvec"]


def build_dir() -> Path:
    configured = os.environ.get("LORAPLEX_NATIVE_DIR")
    return Path(configured) if configured else Path(__file__).parent / "_native"


def _cflags() -> list[str]:
    return shlex.split(os.environ.get("LORAPLEX_NATIVE_CFLAGS", DEFAULT_CFLAGS))


def _tag() -> str:
    """What the library depends on: its source, the flags and the torch it was built against."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.glob("*.[ch]*")):
        digest.update(path.read_bytes())
    digest.update(" ".join([*_cflags(), "link-apart", *_LINK]).encode())
    digest.update(torch.__version__.encode())
    return digest.hexdigest()[:16]


def library_path() -> Path:
    return build_dir() / f"loraplex_cpu_{_tag()}.so"


def build(*, verbose: bool = False) -> Path:
    """Compile the sources into library_path() unless it is already there; returns the path."""
    from torch.utils.cpp_extension import include_paths, library_paths

    target = library_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compiler = os.environ.get("CXX", "g++")
    objects = [target.with_name(f"{target.stem}_{source.stem}.o") for source in SOURCES]
    # Compiled with the flags, linked without them: gcc links crtfastmath.o into a library linked with -ffast-math,
    # and that object turns on flush-to-zero for the whole process that loads it (every float op, not only ours).
    for source, obj in zip(SOURCES, objects, strict=True):
        command = [
            compiler,
            "-c",
            "-fPIC",
            *_cflags(),
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{p}" for p in include_paths()),
            f"-I{sysconfig.get_paths()['include']}",
            str(source),
            "-o",
            str(obj),
        ]
        if verbose:
            print(" ".join(command))
        subprocess.run(command, check=True)
    command = [
        compiler,
        "-shared",
        "-fPIC",
        *(str(obj) for obj in objects),
        "-o",
        str(target.with_suffix(".tmp")),
        *(f"-L{p}" for p in library_paths()),
        *_LINK,
        *(f"-Wl,-rpath,{p}" for p in library_paths()),
    ]
    if verbose:
        print(" ".join(command))
    subprocess.run(command, check=True)
    for obj in objects:
        obj.unlink()
    target.with_suffix(".tmp").rename(target)  # atomic: a concurrent loader never sees half a library
    return target


@cache
def load() -> bool:
    """Register torch.ops.loraplex_cpu from the built library; False when disabled or not built."""
    if os.environ.get("LORAPLEX_NATIVE", "1") == "0":
        return False
    path = library_path()
    if not path.exists():
        return False
    torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]
    return True


def main() -> None:
    """`python -m loraplex.kernels.native`: build the library; a machine without a compiler keeps the torch paths."""
    try:
        path = build(verbose="-v" in sys.argv)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(
            f"warning: loraplex's native CPU operators were not built ({exc}); the torch paths serve", file=sys.stderr
        )
        return
    print(f"built {path}")


if __name__ == "__main__":
    main()
