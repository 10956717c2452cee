"""Building and loading the compiled kernels (`plugins/compiled.py`): a build killed mid-way leaves torch's `lock`
file in the build directory, and torch's loader then waits for it forever; the next start must not hang."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trtllm_dflash.runtime.suffix_index import KERNEL

LOAD = ("from trtllm_dflash.plugins.compiled import CompiledKernel\n"
        "from trtllm_dflash.runtime.suffix_index import KERNEL\n"
        "fresh = CompiledKernel(KERNEL.source, KERNEL.prefix, KERNEL.what, KERNEL.fallback)\n"
        "assert fresh.module() is not None, fresh.unavailable_reason()\n")


def test_a_killed_builds_lock_does_not_hang_the_next_start():
    if KERNEL.module() is None:
        pytest.skip(f"the compiled suffix index is unavailable: {KERNEL.unavailable_reason()}")
    stale = KERNEL.build_directory() / "lock"
    stale.touch()  # what a build killed while it held torch's baton leaves behind
    try:
        done = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=120)
    finally:
        stale.unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_each_torch_installation_builds_into_a_directory_of_its_own(monkeypatch):
    """Two venvs with the same torch version keep separate builds: torch's loader writes the installation's include
    paths into build.ninja, so a shared directory was rebuilt at every switch between them."""
    import torch

    here = KERNEL.build_name()
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/lib/python3/site-packages/torch/__init__.py")
    elsewhere = KERNEL.build_name()
    assert elsewhere != here and elsewhere.startswith(KERNEL.prefix)
    monkeypatch.undo()
    assert KERNEL.build_name() == here
