"""The engine manifest and `open_engine`: an engine directory proves it is whole before use.

`manifest.json` lists every file of the engine with its size and sha256 and ends with
`"complete": true`. It is the last file a build writes, and the build directory only gets its
final name after that, so a directory without a complete manifest is an interrupted build.
`open_engine` checks sizes always (cheap: catches truncation and most tampering) and every sha256
on request (`verify_checksums=True`, what `dflash-run --verify` does).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoints.hf import read_json
from ..errors import InputError
from .options import LlmApiOptions

FORMAT = "trtllm-dflash-engine"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
OPTIONS_FILE = "llm_api_options.yaml"
TARGET, DRAFTER, TRITON = "target", "drafter", "triton"
CHUNK = 8 * 2**20

FileRecord = dict[str, int | str]  # {"size": bytes, "sha256": hex}


def sha256_file(path: Path, on_bytes: Callable[[int], Any] | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    return digest.hexdigest()


def file_record(path: Path, on_bytes: Callable[[int], Any] | None = None) -> FileRecord:
    return {"size": path.stat().st_size, "sha256": sha256_file(path, on_bytes)}


def list_files(root: Path, skip: Iterable[str] = ()) -> list[str]:
    """Relative POSIX paths of the regular files under root, sorted, without the skipped top-level names."""
    skipped = set(skip)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and p.relative_to(root).parts[0] not in skipped)


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary sibling and rename, with fsync, so a reader sees old or new, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_manifest(root: Path, content: dict[str, Any], files: dict[str, FileRecord]) -> Path:
    """The manifest, `complete` last (in the file and in time)."""
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **content, "files": files, "complete": True}
    path = root / MANIFEST
    write_atomic(path, json.dumps(manifest, indent=2) + "\n")
    return path


@dataclass(frozen=True)
class Engine:
    """A verified engine directory. Paths inside the engine are absolute here; files keep them relative."""

    root: Path
    target_dir: Path
    drafter_dir: Path
    options_path: Path
    manifest: dict[str, Any]

    @property
    def triton_dir(self) -> Path | None:
        path = self.root / TRITON
        return path if path.is_dir() else None

    @property
    def block_size(self) -> int:
        return int(self.manifest["drafter"]["block_size"])

    def runtime_setting(self, name: str) -> int | None:
        """A positive integer of the manifest's "runtime" section (the reference runtime's own settings); None: not set."""
        value = self.manifest.get("runtime", {}).get(name)
        if value is not None and not (type(value) is int and value >= 1):
            raise InputError(f"expected an integer >= 1, got {value!r}.", path=self.root / MANIFEST,
                             field=f"runtime.{name}")
        return value

    @property
    def sa_threshold(self) -> int | None:
        """The reference runtime's dflash-sa threshold (`dflash-build --sa-threshold`); None: not set."""
        return self.runtime_setting("sa_threshold")

    @property
    def sa_max_drafts(self) -> int | None:
        """dflash-sa's longest suffix draft (`dflash-build --sa-max-drafts`); None: not set (the runtime's default)."""
        return self.runtime_setting("sa_max_drafts")

    def llm_api_options(self) -> LlmApiOptions:
        """The options with `speculative_model` resolved against the engine root (it is stored
        relative so the directory can move; TensorRT-LLM itself resolves it against its cwd)."""
        options = LlmApiOptions.from_yaml(self.options_path)
        spec = options.speculative_config
        if spec is not None and not Path(spec.speculative_model).is_absolute():
            resolved = spec.model_copy(update={"speculative_model": str(self.root / spec.speculative_model)})
            options = options.model_copy(update={"speculative_config": resolved})
        return options


def open_engine(path: str | Path, verify_checksums: bool = False) -> Engine:
    """Open an engine built by `dflash-build`; refuse one that is incomplete, truncated or altered."""
    root = Path(path)
    if not root.is_dir():
        raise InputError("not a directory; expected an engine directory written by dflash-build.", path=root)
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise InputError("missing: this is not a finished engine (an interrupted build never gets this name); "
                         "rebuild with dflash-build.", path=manifest_path)
    manifest = read_json(manifest_path)
    if manifest.get("format") != FORMAT:
        raise InputError(f"expected {FORMAT!r}, got {manifest.get('format')!r}.", path=manifest_path, field="format")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise InputError(f"this toolkit reads version {FORMAT_VERSION}, got {manifest.get('format_version')!r}; "
                         "rebuild the engine.", path=manifest_path, field="format_version")
    if manifest.get("complete") is not True:
        raise InputError("the build did not finish; rebuild the engine.", path=manifest_path, field="complete")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise InputError("expected a non-empty object of file records.", path=manifest_path, field="files")
    for name, record in files.items():
        if not (isinstance(record, dict) and type(record.get("size")) is int and isinstance(record.get("sha256"), str)):
            raise InputError('expected {"size": integer, "sha256": hex string}.', path=manifest_path,
                             field=f"files[{name!r}]")
        check_file(root, name, record, verify_checksums)
    engine = Engine(root, root / TARGET, root / DRAFTER, root / OPTIONS_FILE, manifest)
    engine.llm_api_options()  # parsed and validated here, so every command refuses a damaged options file
    engine.sa_threshold, engine.sa_max_drafts  # read here too, so a damaged runtime section is refused on open
    return engine


def check_file(root: Path, name: str, record: FileRecord, verify_checksum: bool) -> None:
    file = root / name
    if not file.is_file():
        raise InputError("listed in manifest.json but missing.", path=file)
    size = file.stat().st_size
    if size != record["size"]:
        raise InputError(f"size {size} differs from {record['size']} recorded in manifest.json (truncated or "
                         "modified).", path=file, field="size")
    if verify_checksum and sha256_file(file) != record["sha256"]:
        raise InputError("sha256 differs from manifest.json (modified or corrupt).", path=file, field="sha256")
