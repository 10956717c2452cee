"""Output paths: checked before any work starts, and finished directories published durably.

`check_output_path` runs first, so a command pointed at an unusable place (a missing or read-only
folder, a file where a directory belongs) fails in a second with the path named, not after hours of
work. Every writer here (checkpoint conversion, engine build, Triton repository) works in a temporary
sibling and renames it into place when done. A rename is only as good as the data behind it: on
ext4 and XFS, file data written without fsync may still be in the page cache when the rename
reaches the disk, so after a power loss the final name could hold empty or truncated shards.
`publish_directory` therefore fsyncs every file and directory of the work tree first, then swaps
it in, then fsyncs the parent so the new name itself survives.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..errors import InputError


def check_output_path(path: Path, field: str, directory: bool) -> None:
    """Fail now, naming `path` and the option `field`, unless `path` can become the output: an
    existing path must be of the right kind, and the nearest existing folder above must accept new
    files. That is probed with a temporary file, which also catches read-only mounts and /proc."""
    kind = "directory" if directory else "file"
    if path.exists():
        if path.is_dir() != directory:
            raise InputError(f"expected a {kind} here, found a {'directory' if path.is_dir() else 'file'}.",
                             path=path, field=field)
        if not os.access(path, os.W_OK):
            raise InputError("exists but is not writable.", path=path, field=field)
    folder = path.absolute().parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise InputError(f"cannot be created: {folder} is a file, not a directory.", path=path, field=field)
    try:
        handle, probe = tempfile.mkstemp(prefix=".write-probe-", dir=folder)
    except OSError as exc:
        raise InputError(f"cannot be created: {folder} does not accept new files ({exc.strerror}).",
                         path=path, field=field) from None
    os.close(handle)
    os.unlink(probe)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: Path) -> None:
    """fsync every regular file under root, then every directory, deepest first.

    Files a writer has just closed are mostly written back already once a multi-GB job ends (the
    kernel starts at dirty_background_ratio), so this costs only what is still dirty.
    """
    directories = [root]
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            continue
        if path.is_dir():
            directories.append(path)
        elif path.is_file():
            fsync_path(path)
    for directory in sorted(directories, key=lambda d: len(d.parts), reverse=True):
        fsync_path(directory)


def publish_directory(work: Path, output: Path) -> None:
    """Make `work` durable and give it the name `output`. An existing output is moved aside first
    and removed only after the swap, so at every instant the output path is absent, old, or
    new-and-complete, also after a crash."""
    sync_tree(work)
    if output.exists():
        old = output.with_name(f".{output.name}.old-{os.getpid()}")
        output.rename(old)
        work.rename(output)
        shutil.rmtree(old)
    else:
        work.rename(output)
    fsync_path(output.parent)
