"""Sharded safetensors reading and streaming writing, with bounded memory.

Reading: headers are parsed and validated up front (so a truncated file fails before any work,
naming file and tensor); data is read one slice at a time through ``safetensors.safe_open``,
re-opened per read so no memory map stays resident longer than one slice. ``ShardedReader.mapped``
instead maps one tensor's rows lazily, for passes that look at only a few of their elements.

Writing: the header of a shard is computed from the tensor list before any data exists, then
pieces are written at their final offsets as they are produced. Memory is one piece, not one
shard, whatever the model size. A piece is either a tensor (one ``pwrite`` of its contiguous
bytes) or a :class:`FileRange` of a source shard, copied file to file by the kernel
(``os.copy_file_range``; a buffered ``pread``/``pwrite`` loop where that is unavailable or fails),
so tensors that are copied unchanged never pass through Python.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from trtllm_dflash.errors import InputError

from .hf import INDEX_FILE, SINGLE_FILE, index_weight_map, safetensors_files
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # same sanity limit the safetensors library applies
COPY_BUFFER_BYTES = 16 * 2**20  # buffered-copy fallback granularity
MAX_PENDING_COPIES = 4  # file-range copies / background writes queued behind the one running, per writer
BACKGROUND_WRITE_BYTES = 2**20  # smaller pieces go in the caller's thread unless a background write is pending

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPES_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """Name, dtype and shape of one tensor: enough to lay out a file before the data exists."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class FileRange:
    """``nbytes`` bytes at absolute byte ``offset`` of file ``path``: tensor data to copy verbatim."""

    path: Path
    offset: int
    nbytes: int


# ----------------------------------------------------------------------------------------------
# reading


def read_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, int]]:
    """Parse and validate a safetensors header -> (tensor infos, each tensor's absolute byte offset
    in the file); InputError on a missing, truncated or corrupt file."""
    path = Path(path)
    if not path.is_file():
        raise InputError("file not found", path=path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise InputError(f"file is {size} bytes, too short for a safetensors header", path=path, field="header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise InputError(f"header length {header_len} exceeds the file ({size} bytes)", path=path, field="header")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InputError(f"header is not valid JSON ({e})", path=path, field="header") from None
    data_bytes = size - 8 - header_len
    infos, offsets = {}, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES_BY_NAME.get(entry.get("dtype"))
        if dtype is None:
            raise InputError(f"unsupported dtype {entry.get('dtype')!r}", path=path, field=name)
        info = TensorInfo(name, dtype, tuple(entry["shape"]))
        begin, end = entry["data_offsets"]
        if end - begin != info.nbytes:
            raise InputError(f"data_offsets span {end - begin} bytes, shape needs {info.nbytes}", path=path, field=name)
        if end > data_bytes:
            raise InputError(
                f"file is truncated: tensor ends at byte {end} of a {data_bytes}-byte data section", path=path, field=name
            )
        infos[name] = info
        offsets[name] = 8 + header_len + begin
    return infos, offsets


class ShardedReader:
    """A checkpoint directory's tensors, via ``model.safetensors.index.json`` or ``*.safetensors``."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.files: dict[str, Path] = {}
        self.infos: dict[str, TensorInfo] = {}
        self._offsets: dict[str, int] = {}
        for file in safetensors_files(self.directory):
            infos, offsets = read_header(file)
            for name, info in infos.items():
                if name in self.infos:
                    raise InputError(f"tensor also present in {self.files[name].name}", path=file, field=name)
                self.files[name] = file
                self.infos[name] = info
                self._offsets[name] = offsets[name]
        self._check_index()

    def _check_index(self) -> None:
        index = self.directory / INDEX_FILE
        if not index.is_file():
            return
        for name, file in index_weight_map(index).items():
            if name not in self.infos:
                raise InputError(f"index lists tensor in {file} but no shard holds it", path=index, field=name)
            if self.files[name].name != file:
                raise InputError(f"index says {file}, tensor is in {self.files[name].name}", path=index, field=name)

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Tensor ``name`` (rows ``start:stop`` of dim 0 if given), copied out of the memory map."""
        with safe_open(self.files[name], framework="pt") as f:
            if start is None and stop is None:
                return f.get_tensor(name)
            return f.get_slice(name)[start:stop]

    def mapped(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Tensor ``name`` (rows ``start:stop`` of dim 0 if given) over a copy-on-write memory map of
        just those bytes of its shard: nothing is read until an element is touched, writes never
        reach the file, and the map goes when the tensor does. For passes that look at a few
        elements; reading every element through the map was slower than :meth:`read` here."""
        info = self.infos[name]
        shape, offset = info.shape, self._offsets[name]
        if start is not None or stop is not None:
            rows = range(shape[0])[start:stop]
            offset += rows.start * (info.nbytes // shape[0])
            shape = (len(rows),) + shape[1:]
        nbytes = math.prod(shape) * info.dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=info.dtype)
        array = np.memmap(self.files[name], dtype=np.uint8, mode="c", offset=offset, shape=(nbytes,))
        return torch.from_numpy(array).view(info.dtype).reshape(shape)

    def byte_range(self, name: str) -> FileRange:
        """Where the bytes of tensor ``name`` lie in its shard."""
        return FileRange(self.files[name], self._offsets[name], self.infos[name].nbytes)


# ----------------------------------------------------------------------------------------------
# writing


def shard_names(count: int) -> list[str]:
    """HF shard file names: ``model.safetensors`` for one, ``model-0000i-of-0000n.safetensors`` otherwise."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def group_into_shards(group_bytes: Sequence[int], max_shard_bytes: int) -> list[list[int]]:
    """Greedily pack consecutive groups (indices) into shards of at most ``max_shard_bytes``.

    A group never straddles two shards; one larger than the limit gets a shard of its own.
    """
    shards: list[list[int]] = []
    current, size = [], 0
    for i, nbytes in enumerate(group_bytes):
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        shards.append(current)
    return shards


class StreamingShardWriter:
    """Writes one safetensors file whose layout is fixed up front; tensor data arrives in pieces.

    Each tensor's pieces must arrive in row-major order (they are appended at that tensor's
    cursor); different tensors may interleave. :meth:`close` fails if any tensor is incomplete.

    :class:`FileRange` pieces are copied by one background thread (the kernel copy releases the
    GIL), so copying overlaps whatever computes the next pieces; at most ``MAX_PENDING_COPIES``
    wait, and :meth:`close` (or the next write) re-raises a failed copy. Tensor pieces written with
    ``background=True`` go through the same thread (``pwrite`` releases the GIL too).
    """

    def __init__(self, path: str | Path, infos: Sequence[TensorInfo], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        self._offset: dict[str, int] = {}
        self._end: dict[str, int] = {}
        position = 0
        for info in infos:
            header[info.name] = {
                "dtype": DTYPE_NAMES[info.dtype],
                "shape": list(info.shape),
                "data_offsets": [position, position + info.nbytes],
            }
            self._offset[info.name] = position
            self._end[info.name] = position + info.nbytes
            position += info.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # keep tensor data 8-byte aligned
        self._data_start = 8 + len(encoded)
        self._copier: ThreadPoolExecutor | None = None
        self._copies: deque[Future] = deque()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(self._fd, struct.pack("<Q", len(encoded)) + encoded)
        os.ftruncate(self._fd, self._data_start + position)

    def write(self, name: str, piece: torch.Tensor | FileRange, background: bool = False) -> int:
        """Append ``piece`` (the next bytes of tensor ``name``); returns bytes written.

        A tensor is written with one ``pwrite`` of its contiguous bytes, in the background with
        ``background=True`` (then the caller must not modify it afterwards); a :class:`FileRange` is
        copied from its file by the kernel without passing through Python, in the background.
        """
        nbytes = piece.nbytes if isinstance(piece, FileRange) else piece.numel() * piece.element_size()
        if self._offset[name] + nbytes > self._end[name]:
            raise ValueError(f"{self.path.name}: piece overruns tensor {name}")
        position = self._data_start + self._offset[name]
        if isinstance(piece, FileRange):
            self._submit(copy_range, piece, self._fd, position)
        else:
            data = memoryview(piece.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
            # behind a pending write: writing now, from this thread, would contend for the file's lock
            if background and (nbytes >= BACKGROUND_WRITE_BYTES or self._copies):
                self._submit(_pwrite_all, self._fd, data, position)  # ``data`` keeps the buffer alive
            else:
                _pwrite_all(self._fd, data, position)
        self._offset[name] += nbytes
        return nbytes

    def _submit(self, fn, *args) -> None:
        while self._copies and (self._copies[0].done() or len(self._copies) > MAX_PENDING_COPIES):
            self._copies.popleft().result()  # re-raises a failed copy or write
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="shard-copy")
        self._copies.append(self._copier.submit(fn, *args))

    def _finish_copies(self, raise_errors: bool) -> None:
        """Wait for every queued copy (the file descriptor must outlive them); maybe re-raise the first error."""
        first_error = None
        while self._copies:
            error = self._copies.popleft().exception()  # blocks until that copy is done
            first_error = first_error or error
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None
        if raise_errors and first_error is not None:
            raise first_error

    def close(self) -> None:
        try:
            self._finish_copies(raise_errors=True)
        finally:
            os.close(self._fd)
        incomplete = [n for n, off in self._offset.items() if off != self._end[n]]
        if incomplete:
            raise ValueError(f"{self.path.name}: tensors left incomplete: {incomplete[:5]}")

    def __enter__(self) -> StreamingShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self._finish_copies(raise_errors=False)
            finally:
                os.close(self._fd)


def _pwrite_all(fd: int, data: memoryview, position: int) -> None:
    while len(data):
        written = os.pwrite(fd, data, position)
        data, position = data[written:], position + written


def copy_range(source: FileRange, dst_fd: int, dst_offset: int) -> None:
    """Copy ``source`` to byte ``dst_offset`` of ``dst_fd``: in-kernel ``os.copy_file_range`` where it
    works (no user-space copy); otherwise (not available, cross-device on old kernels, unsupported
    file system: any ``OSError``, or no progress) a buffered ``pread``/``pwrite`` of the rest."""
    done = 0
    src_fd = os.open(source.path, os.O_RDONLY)
    try:
        kernel_copy = getattr(os, "copy_file_range", None)
        if kernel_copy is not None:
            try:
                while done < source.nbytes:
                    copied = kernel_copy(src_fd, dst_fd, source.nbytes - done, source.offset + done, dst_offset + done)
                    if copied == 0:
                        break  # end of file, or a file system that copies nothing: the loop below decides
                    done += copied
            except OSError:
                pass
        while done < source.nbytes:
            chunk = os.pread(src_fd, min(COPY_BUFFER_BYTES, source.nbytes - done), source.offset + done)
            if not chunk:
                raise InputError(
                    f"file is truncated: expected {source.nbytes} bytes at offset {source.offset}", path=source.path
                )
            _pwrite_all(dst_fd, memoryview(chunk), dst_offset + done)
            done += len(chunk)
    finally:
        os.close(src_fd)


def write_index(directory: str | Path, weight_map: dict[str, str], total_size: int) -> Path:
    """Write ``model.safetensors.index.json`` (``metadata.total_size`` + sorted ``weight_map``)."""
    path = Path(directory) / INDEX_FILE
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    path.write_text(json.dumps(index, indent=2) + "\n")
    return path


def save_sharded(
    directory: str | Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int = 5 * 2**30
) -> dict[str, str]:
    """Save an in-memory state dict as HF shards + index (small models, fixtures). Returns the weight map."""
    infos = [TensorInfo(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    groups = group_into_shards([i.nbytes for i in infos], max_shard_bytes)
    weight_map = {}
    for file, members in zip(shard_names(len(groups)), groups):
        with StreamingShardWriter(Path(directory) / file, [infos[i] for i in members]) as writer:
            for i in members:
                writer.write(infos[i].name, tensors[infos[i].name])
                weight_map[infos[i].name] = file
    write_index(directory, weight_map, sum(i.nbytes for i in infos))
    return weight_map


def iter_ranges(reader: ShardedReader, name: str, max_piece_bytes: int) -> Iterable[FileRange]:
    """Tensor ``name``'s bytes in its shard as consecutive ranges of at most ``max_piece_bytes``."""
    whole = reader.byte_range(name)
    for start in range(0, whole.nbytes, max_piece_bytes):
        yield FileRange(whole.path, whole.offset + start, min(max_piece_bytes, whole.nbytes - start))
    if whole.nbytes == 0:
        yield whole
