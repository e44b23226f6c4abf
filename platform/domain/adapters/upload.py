"""An adapter upload turned into the two files the engine's validator reads: adapter_config.json and
adapter_model.safetensors, sent as two file parts or packed in one .zip or .tar.gz (.tgz); optionally with the two
files of a draft counterpart beside them, draft/adapter_config.json and draft/adapter_model.safetensors (the LoRA the
base model's draft model runs for the adapter's requests: engine/core/draft_adapters.py), both or neither.

Everything here works on bytes in memory: archives are read member by member through zipfile / tarfile over
BytesIO and nothing is ever extracted to disk. Refused before the validator sees a byte: pickle (by name, by
pickle's protocol header at the start of any file, and the zip archives torch.save writes), Python files, an
`auto_map` in a config (custom model code), and any archive member other than the two files at the root and the two
in draft/ (other folders, paths, `..`, links, devices, duplicates, extra files). Archives may not unpack to more than
the limits, judged twice: by the sizes each member declares, and by counting the bytes actually read; the total
limit covers all four files.

Failures raise AdapterFormatError (UploadTooLarge for sizes), whose `field` names the part or member at fault,
so the API reports them exactly as it reports the validator's own errors. All of it blocks: run it in a worker
thread.
"""

from __future__ import annotations

import gzip
import io
import json
import lzma
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from loraplex.engine.lora import (
    CONFIG_FILE,
    DRAFT_FOLDER,
    FORBIDDEN_SUFFIXES,
    MAX_CONFIG_BYTES,
    WEIGHTS_FILE,
    AdapterFormatError,
    UnsupportedAdapterFeature,
    shorten,
)

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
# Where the engine looks for an adapter's draft counterpart: the same two files in its draft/ folder.
DRAFT_CONFIG_FILE = f"{DRAFT_FOLDER}/{CONFIG_FILE}"
DRAFT_WEIGHTS_FILE = f"{DRAFT_FOLDER}/{WEIGHTS_FILE}"
DRAFT_FILES = (DRAFT_CONFIG_FILE, DRAFT_WEIGHTS_FILE)
_UPLOAD_FILES = (*ADAPTER_FILES, *DRAFT_FILES)
_CONFIG_FILES = (CONFIG_FILE, DRAFT_CONFIG_FILE)
ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz")
_CODE_SUFFIXES = (".py", ".pyc")
_READ_CHUNK_BYTES = 1 << 20
# A tar stream holds more than its members' bytes: 512-byte headers (more for long names), padding to 512 bytes
# and the end-of-archive blocks. Allowed on top of the members' total when counting inflated bytes.
_TAR_OVERHEAD_BYTES = 1 << 20
# A zip local file header, and the end record that is all an empty zip holds; torch.save writes zip archives too.
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
_GZIP_MAGIC = b"\x1f\x8b"
_HOW = (
    f"send {CONFIG_FILE} and {WEIGHTS_FILE} as two file parts, or one .zip or .tar.gz holding exactly those two "
    f"files at its root (a draft counterpart adds {DRAFT_CONFIG_FILE} and {DRAFT_WEIGHTS_FILE}, as parts or members)"
)
_HOW_ARCHIVE = (
    f"the archive must hold exactly {CONFIG_FILE} and {WEIGHTS_FILE} at its root, with no folders other than "
    f"{DRAFT_FOLDER}/ holding a draft counterpart's two files (for example "
    f"`zip -j adapter.zip DIR/{CONFIG_FILE} DIR/{WEIGHTS_FILE}`, or "
    f"`tar czf adapter.tar.gz -C DIR {CONFIG_FILE} {WEIGHTS_FILE} {DRAFT_FOLDER}` with a counterpart)"
)


class UploadTooLarge(AdapterFormatError):
    """The upload unpacks to more bytes than this server accepts (the API answers 413)."""


@dataclass(frozen=True, slots=True)
class UploadedFile:
    """One file part of the multipart body: its field name, the filename the client gave (if any), its bytes."""

    field: str
    filename: str | None
    data: bytes

    @property
    def label(self) -> str:
        """How messages name the part: the client's filename, else the field name."""
        return self.filename or self.field


@dataclass(frozen=True, slots=True)
class UploadLimits:
    """Byte limits on what an archive unpacks to: per file, and in all."""

    max_weights_bytes: int
    max_total_bytes: int
    max_config_bytes: int = MAX_CONFIG_BYTES


@dataclass(frozen=True, slots=True)
class AdapterFiles:
    """The two files of an adapter, not yet validated against a base model (that is parse_adapter's job)."""

    config: bytes
    weights: bytes


@dataclass(frozen=True, slots=True)
class UploadFiles:
    """What an upload holds: the adapter's two files, and its draft counterpart's if it has one (for the base
    model's draft model, not the base model)."""

    adapter: AdapterFiles
    draft: AdapterFiles | None = None

    def named(self) -> list[tuple[str, bytes]]:
        """Each file with its path in the adapter's folder (draft/ for the counterpart's)."""
        files = [(CONFIG_FILE, self.adapter.config), (WEIGHTS_FILE, self.adapter.weights)]
        if self.draft is not None:
            files += [(DRAFT_CONFIG_FILE, self.draft.config), (DRAFT_WEIGHTS_FILE, self.draft.weights)]
        return files


def read_upload(parts: Sequence[UploadedFile], limits: UploadLimits) -> UploadFiles:
    """The adapter's two files (and its draft counterpart's) from the file parts of an upload; raise
    AdapterFormatError naming what is wrong.

    A part is the config (or the weights) when its field name or its filename is adapter_config.json (or
    adapter_model.safetensors), a draft counterpart's when it is draft/adapter_config.json (or
    draft/adapter_model.safetensors); otherwise it must be a .zip or .tar.gz archive, recognised by its content or
    its name. Either the files or one archive: anything else is refused.
    """
    for part in parts:
        for name in (part.field, part.filename):
            if name is not None:
                _refuse_by_name(name, where=f"the upload holds '{shorten(name)}'")
        _refuse_pickle(part.data, where=f"'{shorten(part.label)}'", field=part.label)

    found: dict[str, list[UploadedFile]] = {name: [] for name in _UPLOAD_FILES}
    archives: list[UploadedFile] = []
    for part in parts:
        role = next((name for name in (part.field, part.filename) if name in _UPLOAD_FILES), None)
        if role is not None:
            found[role].append(part)
        elif _looks_like_archive(part):
            archives.append(part)
        else:
            raise AdapterFormatError(
                f"the upload holds an unexpected file '{shorten(part.label)}': {_HOW}", field=shorten(part.label)
            )

    if archives:
        loose = [part for name in _UPLOAD_FILES for part in found[name]]
        if loose:
            raise AdapterFormatError(
                f"the upload holds an archive ('{shorten(archives[0].label)}') and loose files "
                f"('{shorten(loose[0].label)}'): send one or the other",
                field=shorten(loose[0].label),
            )
        if len(archives) > 1:
            raise AdapterFormatError(
                f"the upload holds {len(archives)} archives ('{shorten(archives[0].label)}', "
                f"'{shorten(archives[1].label)}'); send one",
                field=shorten(archives[1].label),
            )
        files = read_archive(archives[0].data, label=archives[0].label, limits=limits)
    else:
        for name, candidates in found.items():
            if not candidates and name in ADAPTER_FILES:
                raise AdapterFormatError(f"the upload has no {name}: {_HOW}", field=name)
            if len(candidates) > 1:
                raise AdapterFormatError(f"the upload holds {name} {len(candidates)} times; send it once", field=name)
        files = _upload_files(
            {name: candidates[0].data for name, candidates in found.items() if candidates}, where="the upload"
        )
    for name, data in files.named():
        _refuse_pickle(data, where=name, field=name)
        if data.startswith(_ZIP_MAGICS):
            raise AdapterFormatError(
                f"{name} is a zip archive, the format torch.save writes its pickles in: pickle can run code when "
                f"loaded and is refused; {WEIGHTS_FILE} must be safetensors (PEFT's save_pretrained writes it)",
                field=name,
            )
    refuse_custom_code(files.adapter.config)
    if files.draft is not None:
        refuse_custom_code(files.draft.config, name=DRAFT_CONFIG_FILE)
    return files


def read_archive(data: bytes, *, label: str, limits: UploadLimits) -> UploadFiles:
    """The files from a .zip or .tar.gz (told apart by content), read in memory under `limits`."""
    if data.startswith(_ZIP_MAGICS):
        return _read_zip(data, label, limits)
    if data.startswith(_GZIP_MAGIC):
        return _read_tar_gz(data, label, limits)
    raise AdapterFormatError(
        f"'{shorten(label)}' is neither a zip archive nor a gzip-compressed tar archive", field=shorten(label)
    )


def refuse_custom_code(config: bytes, *, name: str = CONFIG_FILE) -> None:
    """Refuse an adapter_config.json (`name` in messages) with `auto_map` (transformers' pointer to code shipped
    with a model).

    The engine's validator refuses it too, as an unknown field; this says why. Anything that is not a JSON
    object is left to the validator, which names the problem.
    """
    if len(config) > MAX_CONFIG_BYTES:
        return
    try:
        values = json.loads(config)
    except (ValueError, RecursionError):
        return
    if isinstance(values, dict) and values.get("auto_map") not in (None, False, "", [], {}):
        raise UnsupportedAdapterFeature(
            f"{name} field 'auto_map' is {shorten(repr(values['auto_map']), 80)}: it points to custom model "
            "code, and loraplex never runs code that comes with an upload; remove 'auto_map'",
            field="auto_map",
        )


def _upload_files(data: dict[str, bytes], *, where: str) -> UploadFiles:
    """The files found, by their names in _UPLOAD_FILES: both of the adapter's, and both or neither of the draft
    counterpart's (the engine reads one alone as no counterpart, which would hide the mistake)."""
    for name in ADAPTER_FILES:
        if name not in data:
            raise AdapterFormatError(f"{where} has no {name}: {_HOW}", field=name)
    adapter = AdapterFiles(config=data[CONFIG_FILE], weights=data[WEIGHTS_FILE])
    present = [name for name in DRAFT_FILES if name in data]
    if not present:
        return UploadFiles(adapter)
    if len(present) == 1:
        (missing,) = set(DRAFT_FILES) - set(present)
        raise AdapterFormatError(
            f"{where} holds {present[0]} but no {missing}: a draft counterpart needs both files (or neither)",
            field=missing,
        )
    return UploadFiles(adapter, AdapterFiles(config=data[DRAFT_CONFIG_FILE], weights=data[DRAFT_WEIGHTS_FILE]))


# --- names and content ----------------------------------------------------------------------------------------


def _refuse_by_name(name: str, *, where: str) -> None:
    base = name.replace("\\", "/").rstrip("/").rpartition("/")[2].lower()
    if not base.endswith(FORBIDDEN_SUFFIXES):
        return
    if base.endswith(_CODE_SUFFIXES):
        raise AdapterFormatError(
            f"{where}, a Python file: code is never accepted with an adapter; {_HOW}", field=shorten(name)
        )
    raise AdapterFormatError(
        f"{where}, a pickle file by its name (.bin, .pt, .pth, .pkl, .pickle, .ckpt): loading pickle can run code, "
        f"so it is refused; save the adapter as {WEIGHTS_FILE} (PEFT's save_pretrained does by default)",
        field=shorten(name),
    )


def _refuse_pickle(data: bytes, *, where: str, field: str) -> None:
    # Protocols 2 to 5 start with PROTO (0x80) and the protocol number; torch.save's legacy format is one of them.
    if len(data) >= 2 and data[0] == 0x80 and 2 <= data[1] <= 5:
        raise AdapterFormatError(
            f"{where} is pickle data (it starts with pickle's protocol header): loading pickle can run code, so it "
            "is refused; save the adapter's weights in the safetensors format (PEFT's save_pretrained does by "
            "default)",
            field=shorten(field),
        )


def _looks_like_archive(part: UploadedFile) -> bool:
    names = [name.lower() for name in (part.filename, part.field) if name]
    return part.data.startswith((*_ZIP_MAGICS, _GZIP_MAGIC)) or any(n.endswith(ARCHIVE_SUFFIXES) for n in names)


def _is_draft_folder(name: str, kind: str) -> bool:
    # `zip -r` and `tar` of a folder write an entry for draft/ itself before its files; it holds nothing to read.
    return kind == "folder" and name in (DRAFT_FOLDER, f"{DRAFT_FOLDER}/")


def _check_member(name: str, kind: str, label: str) -> None:
    """One archive member's name and kind ("file", "folder", "symlink", "hardlink", "special")."""
    archive = f"'{shorten(label)}'"
    field = shorten(name)
    _refuse_by_name(name, where=f"{archive} holds '{field}'")
    if _is_draft_folder(name, kind):
        return
    if kind == "folder" or name.endswith("/"):
        raise AdapterFormatError(f"{archive} holds the folder '{field}': {_HOW_ARCHIVE}", field=field)
    parts = name.replace("\\", "/").split("/")
    if name not in DRAFT_FILES and (len(parts) > 1 or name in (".", "..") or name.startswith("/")):
        raise AdapterFormatError(
            f"{archive} holds '{field}', a path with folder components or '..': {_HOW_ARCHIVE}", field=field
        )
    if kind != "file":
        what = {"symlink": "a symbolic link", "hardlink": "a hard link"}.get(kind, "a device or other special file")
        raise AdapterFormatError(
            f"{archive} holds '{field}' as {what}: only regular files are accepted; pack the files themselves",
            field=field,
        )
    if name not in _UPLOAD_FILES:
        raise AdapterFormatError(
            f"{archive} holds '{field}', which is not an adapter file: {_HOW_ARCHIVE}", field=field
        )


class _Members:
    """The files as an archive yields them, with the duplicate and size checks both archive kinds share."""

    def __init__(self, label: str, limits: UploadLimits) -> None:
        self.label = label
        self.limits = limits
        self.files: dict[str, bytes] = {}
        self.admitted: set[str] = set()
        self.num_declared_bytes = 0
        self.num_read_bytes = 0

    def admit(self, name: str, kind: str, declared_size: int) -> int | None:
        """Check a member before reading it; return the most bytes it may inflate to, or None for the draft/
        folder's own entry, which has nothing to read."""
        _check_member(name, kind, self.label)
        if name in self.admitted:
            raise AdapterFormatError(f"'{shorten(self.label)}' holds '{name}' twice", field=name)
        self.admitted.add(name)
        if _is_draft_folder(name, kind):
            return None
        limit = self.limits.max_config_bytes if name in _CONFIG_FILES else self.limits.max_weights_bytes
        if declared_size > limit:
            raise UploadTooLarge(
                f"'{shorten(self.label)}' holds {name} of {declared_size} bytes (as the archive declares it); at most "
                f"{limit} are accepted",
                field=name,
            )
        self.num_declared_bytes += declared_size
        if self.num_declared_bytes > self.limits.max_total_bytes:
            raise UploadTooLarge(
                f"'{shorten(self.label)}' declares more than {self.limits.max_total_bytes} bytes of content, the most "
                "an upload may unpack to",
                field=name,
            )
        return limit

    def read(self, name: str, stream: _Readable, limit: int) -> None:
        """Read a member admitted with `admit`, counting the bytes that actually come out of the decompressor."""
        buffer = bytearray()
        while chunk := stream.read(_READ_CHUNK_BYTES):
            buffer += chunk
            self.num_read_bytes += len(chunk)
            if len(buffer) > limit or self.num_read_bytes > self.limits.max_total_bytes:
                raise UploadTooLarge(
                    f"'{shorten(self.label)}' holds {name}, which unpacks to more bytes than it declares and than this "
                    f"server accepts (at most {min(limit, self.limits.max_total_bytes)})",
                    field=name,
                )
        self.files[name] = bytes(buffer)

    def result(self) -> UploadFiles:
        for name in ADAPTER_FILES:
            if name not in self.files:
                raise AdapterFormatError(f"'{shorten(self.label)}' has no {name}: {_HOW_ARCHIVE}", field=name)
        return _upload_files(self.files, where=f"'{shorten(self.label)}'")


class _Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


# --- zip ------------------------------------------------------------------------------------------------------


def _read_zip(data: bytes, label: str, limits: UploadLimits) -> UploadFiles:
    members = _Members(label, limits)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            infos = archive.infolist()
            # Every member's name, kind and declared size before any is inflated.
            admitted = [(info, members.admit(info.orig_filename, _zip_kind(info), info.file_size)) for info in infos]
            for info, limit in admitted:
                if limit is None:
                    continue
                if info.flag_bits & 0x1:
                    raise AdapterFormatError(
                        f"'{shorten(label)}' holds {info.orig_filename} encrypted; pack it without a password",
                        field=info.orig_filename,
                    )
                try:
                    with archive.open(info) as stream:
                        members.read(info.orig_filename, stream, limit)
                except zipfile.BadZipFile as exc:
                    # zipfile stops a member at its declared size and then checks the CRC, so a member that
                    # inflates past what it declares (a zip bomb) ends here.
                    raise AdapterFormatError(
                        f"'{shorten(label)}' holds {info.orig_filename}, whose content does not match the size and "
                        f"checksum the archive declares for it ({shorten(str(exc))}): a corrupt archive, or one "
                        "that inflates past what it declares",
                        field=shorten(info.orig_filename),
                    ) from None
    except AdapterFormatError:
        raise
    except (zipfile.BadZipFile, zlib.error, lzma.LZMAError, EOFError, NotImplementedError, OSError, ValueError) as exc:
        raise AdapterFormatError(
            f"'{shorten(label)}' is not a readable zip archive ({shorten(str(exc))})", field=shorten(label)
        ) from None
    return members.result()


def _zip_kind(info: zipfile.ZipInfo) -> str:
    if info.is_dir():
        return "folder"
    # Unix tools keep st_mode in the high 16 bits of external_attr; zero there means "a plain file" (Windows).
    mode = info.external_attr >> 16
    if stat.S_IFMT(mode):
        if stat.S_ISREG(mode):
            return "file"
        if stat.S_ISLNK(mode):
            return "symlink"
        return "folder" if stat.S_ISDIR(mode) else "special"
    return "folder" if info.external_attr & 0x10 else "file"  # MS-DOS directory attribute


# --- tar.gz ---------------------------------------------------------------------------------------------------


class _CappedStream:
    """A read-only stream over a decompressor that raises once more than `limit` bytes came out of it."""

    def __init__(self, inner: gzip.GzipFile, *, limit: int, label: str) -> None:
        self._inner = inner
        self._limit = limit
        self._label = label
        self._position = 0

    def read(self, size: int = -1, /) -> bytes:
        chunk = self._inner.read(min(size, self._limit + 1 - self._position) if size >= 0 else self._limit + 1)
        self._position += len(chunk)
        if self._position > self._limit:
            raise UploadTooLarge(
                f"'{shorten(self._label)}' unpacks to more than {self._limit} bytes, the most an upload may unpack to",
                field=shorten(self._label),
            )
        return chunk

    def write(self, b: bytes, /) -> int:
        raise io.UnsupportedOperation("read-only")

    def tell(self) -> int:
        return self._position

    def seek(self, pos: int, /) -> int:
        raise io.UnsupportedOperation("not seekable")

    def close(self) -> None:
        self._inner.close()


def _read_tar_gz(data: bytes, label: str, limits: UploadLimits) -> UploadFiles:
    members = _Members(label, limits)
    inflated = _CappedStream(
        gzip.GzipFile(fileobj=io.BytesIO(data), mode="rb"),
        limit=limits.max_total_bytes + _TAR_OVERHEAD_BYTES,
        label=label,
    )
    try:
        # "r|": a stream read front to back, so each member's header is checked before its bytes are inflated
        # (random access would inflate the whole archive first, to list it).
        with tarfile.open(fileobj=inflated, mode="r|") as archive:
            for member in archive:
                limit = members.admit(member.name, _tar_kind(member), member.size)
                if limit is None:
                    continue
                stream = archive.extractfile(member)
                if stream is None:  # only for non-files, which admit refused
                    raise AdapterFormatError(f"'{shorten(label)}': cannot read '{member.name}'", field=member.name)
                members.read(member.name, stream, limit)
    except AdapterFormatError:
        raise
    except (tarfile.TarError, zlib.error, EOFError, OSError, ValueError) as exc:
        raise AdapterFormatError(
            f"'{shorten(label)}' is not a readable .tar.gz archive ({shorten(str(exc))})", field=shorten(label)
        ) from None
    return members.result()


def _tar_kind(member: tarfile.TarInfo) -> str:
    if member.isdir():
        return "folder"
    if member.issym():
        return "symlink"
    if member.islnk():
        return "hardlink"
    if member.isreg() and not member.issparse():
        return "file"
    return "special"
