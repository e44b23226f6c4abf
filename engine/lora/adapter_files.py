"""An adapter's two files: reading them from a folder (safetensors only, never pickle or code) and their digest."""

from __future__ import annotations

import hashlib
import stat
import struct
from pathlib import Path

from loraplex.engine.lora.adapter_config import CONFIG_FILE, MAX_CONFIG_BYTES
from loraplex.engine.lora.errors import AdapterFormatError

WEIGHTS_FILE = "adapter_model.safetensors"
# Beside an adapter's two files: its draft counterpart's two files, the LoRA a draft model runs for its requests
# (engine/core/draft_adapters.py).
DRAFT_FOLDER = "draft"
DEFAULT_MAX_WEIGHTS_BYTES = 4 << 30
# Pickle (torch.save) and code: loading either can run anything, so their mere presence refuses the folder.
FORBIDDEN_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".py", ".pyc")
_DIGEST_DOMAIN = b"loraplex-adapter-v1\0"


def adapter_digest(config_bytes: bytes, weights_bytes: bytes) -> str:
    """ "sha256:<hex>" over both files, the identity of an adapter's content (prefix-cache keys, dedup).

    Framing: a domain tag, then each file as its 8-byte big-endian length followed by its bytes, so no two
    different pairs of files give the same stream (moving bytes from one file to the other changes a length).
    """
    digest = hashlib.sha256(_DIGEST_DOMAIN)
    for content in (config_bytes, weights_bytes):
        digest.update(struct.pack(">Q", len(content)))
        digest.update(content)
    return f"sha256:{digest.hexdigest()}"


def read_adapter_dir(path: Path, *, max_weights_bytes: int = DEFAULT_MAX_WEIGHTS_BYTES) -> tuple[bytes, bytes]:
    """(adapter_config.json, adapter_model.safetensors) bytes from a folder PEFT's save_pretrained wrote.

    Refuses a folder holding pickle or Python files (even beside valid files: an upload that ships them is
    not what it claims), and symbolic links for the two files (they could point anywhere on this machine).
    """
    try:
        found = path.is_dir()
    except (OSError, ValueError):  # a name longer than the filesystem allows, a NUL byte
        found = False
    if not found:
        raise AdapterFormatError(f"adapter folder {path} does not exist or is not a folder", field=str(path))
    for entry in sorted(path.iterdir()):
        if entry.name.lower().endswith(FORBIDDEN_SUFFIXES):
            raise AdapterFormatError(
                f"the adapter folder holds '{entry.name}': pickle and Python files are refused, because loading "
                f"them can run code; ship only {CONFIG_FILE} and {WEIGHTS_FILE}",
                field=entry.name,
            )
    return _read(path, CONFIG_FILE, MAX_CONFIG_BYTES), _read(path, WEIGHTS_FILE, max_weights_bytes)


def _read(folder: Path, name: str, max_bytes: int) -> bytes:
    file = folder / name
    try:
        info = file.lstat()
    except FileNotFoundError:
        raise AdapterFormatError(f"the adapter folder has no {name}", field=name) from None
    if not stat.S_ISREG(info.st_mode):
        raise AdapterFormatError(f"{name} in the adapter folder is not a regular file (a link?)", field=name)
    if info.st_size > max_bytes:
        raise AdapterFormatError(f"{name} is {info.st_size} bytes; at most {max_bytes} are accepted", field=name)
    return file.read_bytes()
