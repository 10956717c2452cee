"""Offline training corpus for the embedded default pair: the running interpreter's stdlib.

Why the stdlib: it is real, varied, well-written Python that every machine already has, so the
embedded target can be trained (and re-trained) with no network and no data download.

File rules (applied to the relative paths below ``sysconfig.get_paths()["stdlib"]``):

* only ``*.py`` files, walked in sorted relative-path order (POSIX separators);
* skipped directories (any path component): ``site-packages`` (third-party code, differs per
  machine), ``test``, ``tests``, ``idle_test`` (test suites and the lib2to3 / idlelib test data,
  full of deliberately odd code), ``pydoc_data`` (a dump of the docs), ``__pycache__``,
  ``lib-dynload``;
* skipped files: ``_sysconfigdata*`` (machine-specific generated dict), files larger than
  ``MAX_FILE_BYTES`` (giant generated tables / doc dumps), files whose first ``GENERATED_HEAD_LINES``
  lines say "generated" (codec tables made by gencodec.py, token lists: machine output, not code
  to learn from), files that are not valid UTF-8, and empty files.

Corpus versions: v1 (the corpus of the shipped pair) applies the rules above. v2 also takes the
test suites in directories named ``test`` (CPython's own ``test`` package and the ``*/test``
packages of unittest, ctypes, tkinter, ...; they add 1.7x v1's text), because v1 is too small for the
target: it over-fits after a few passes. lib2to3's ``tests`` and idlelib's ``idle_test`` stay out.

Split: by *file*, so no held-out text is ever seen in training. A file is held out when the first
8 bytes of ``sha256(relative path)`` taken as an integer fall below ``HELDOUT_FRACTION`` of 2**64;
this depends only on the path, so the split is stable across runs and machines and adding or
removing other files never moves a file between splits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

MAX_FILE_BYTES = 256_000
GENERATED_HEAD_LINES = 10
HELDOUT_FRACTION = 0.05
SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "pydoc_data", "__pycache__", "lib-dynload"})
SKIP_DIRS_OF_VERSION = {1: SKIP_DIRS, 2: SKIP_DIRS - {"test"}}
SKIP_FILE_PREFIXES = ("_sysconfigdata",)

# Held-out prompts: snippets of PROMPT_MIN_LINES..PROMPT_MAX_LINES whole lines.
NUM_PROMPTS = 300
PROMPT_MIN_LINES = 8
PROMPT_MAX_LINES = 20
PROMPT_SEED = 1234


@dataclass(frozen=True)
class Prompt:
    """A held-out snippet a model should continue; ``path``/``line`` say where it came from."""

    path: str
    line: int
    text: str


def stdlib_root() -> Path:
    """Directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    """Deterministic by-file split: a stable hash of the relative path (see module docstring)."""
    h = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big")
    return h < HELDOUT_FRACTION * 2**64


def read_source(path: Path) -> str | None:
    """Text of one candidate file, or None when a file rule excludes it."""
    data = path.read_bytes()
    if not data.strip() or len(data) > MAX_FILE_BYTES:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    head = "\n".join(text.splitlines()[:GENERATED_HEAD_LINES]).lower()
    if "generated" in head:
        return None
    return text.replace("\r\n", "\n")


def list_files(root: Path | None = None, version: int = 1) -> list[str]:
    """Sorted relative paths of every file of corpus ``version`` (both splits)."""
    root = root or stdlib_root()
    skip_dirs = SKIP_DIRS_OF_VERSION[version]
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if any(part in skip_dirs for part in rel.parts[:-1]) or rel.name.startswith(SKIP_FILE_PREFIXES):
            continue
        if p.is_file() and read_source(p) is not None:
            out.append(rel.as_posix())
    return sorted(out)


def split_files(root: Path | None = None, version: int = 1) -> dict[str, list[str]]:
    """``{"train": [...], "heldout": [...]}``, each sorted."""
    files = list_files(root, version)
    return {
        "train": [f for f in files if not is_heldout(f)],
        "heldout": [f for f in files if is_heldout(f)],
    }


def iter_texts(split: str, root: Path | None = None, version: int = 1) -> Iterator[str]:
    """Text of each file of ``split`` ("train" or "heldout") of corpus ``version``, in sorted path order."""
    root = root or stdlib_root()
    for rel in split_files(root, version)[split]:
        text = read_source(root / rel)
        assert text is not None, rel
        yield text


def heldout_prompts(n: int = NUM_PROMPTS, seed: int = PROMPT_SEED, root: Path | None = None) -> list[Prompt]:
    """``n`` deterministic held-out snippets of whole lines, for greedy-continuation checks.

    Each snippet starts on a non-blank line, spans PROMPT_MIN_LINES..PROMPT_MAX_LINES lines and has
    at least one line after it in the file; a snippet that is mostly blank lines is redrawn. It ends
    at the end of its last line *without* the newline: the byte-level BPE merges a newline with the
    next line's indentation into one token, so a prompt ending in a bare newline forces a token
    boundary the model has mostly seen right before end-of-file (it then tends to emit EOS).
    Prompts always come from v1's held-out library files, so every corpus version is measured on
    the same prompts.
    """
    root = root or stdlib_root()
    files = split_files(root)["heldout"]
    return snippets({f: read_source(root / f).splitlines(keepends=True) for f in files}, n, seed)


def snippets(lines_of: dict[str, list[str]], n: int, seed: int, min_lines: int = PROMPT_MIN_LINES,
             max_lines: int = PROMPT_MAX_LINES) -> list[Prompt]:
    """``n`` deterministic snippets of ``min_lines..max_lines`` whole lines of the files ``lines_of``
    (path -> lines with their ends), by the rules of ``heldout_prompts``."""
    files = sorted(lines_of)
    candidates = [f for f in files if len(lines_of[f]) > max_lines + 1]
    rng = random.Random(seed)
    prompts: list[Prompt] = []
    while len(prompts) < n:
        f = rng.choice(candidates)
        lines = lines_of[f]
        length = rng.randint(min_lines, max_lines)
        start = rng.randrange(0, len(lines) - length)
        chunk = lines[start : start + length]
        if not chunk[0].strip() or sum(1 for line in chunk if line.strip()) < length * 3 // 4:
            continue
        prompts.append(Prompt(path=f, line=start + 1, text="".join(chunk)[:-1]))
    return prompts


def split_record(root: Path | None = None, version: int = 1) -> dict:
    """JSON-ready description of the split for the model card: version, rules, counts, hash, list."""
    root = root or stdlib_root()
    split = split_files(root, version)
    listing = "".join(f"{s}\t{f}\n" for s in ("train", "heldout") for f in split[s])

    def nbytes(files: list[str]) -> int:
        return sum((root / f).stat().st_size for f in files)

    return {
        "source": "Python standard library of the training interpreter",
        "corpus_version": version,
        "python_version": sys.version.split()[0],
        "implementation": sys.implementation.name,
        "rules": {
            "glob": "*.py",
            "skip_dirs": sorted(SKIP_DIRS_OF_VERSION[version]),
            "skip_file_prefixes": list(SKIP_FILE_PREFIXES),
            "max_file_bytes": MAX_FILE_BYTES,
            "skip_if_head_says_generated_lines": GENERATED_HEAD_LINES,
            "utf8_only": True,
            "heldout": f"sha256(relpath)[:8] as big-endian int < {HELDOUT_FRACTION} * 2**64",
        },
        "counts": {s: {"files": len(split[s]), "bytes": nbytes(split[s])} for s in split},
        "list_sha256": hashlib.sha256(listing.encode("utf-8")).hexdigest(),
        "heldout_files": split["heldout"],
    }


def main() -> None:
    """Write the split record JSON (``python -m trtllm_dflash.train.corpus --out split.json``)."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--version", type=int, choices=sorted(SKIP_DIRS_OF_VERSION), default=1)
    args = ap.parse_args()
    rec = split_record(version=args.version)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps(rec["counts"]), rec["list_sha256"])


if __name__ == "__main__":
    main()
