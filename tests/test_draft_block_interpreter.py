"""Runs tests/test_draft_block_triton.py in a subprocess with TRITON_INTERPRET=1.

Needed when triton was imported in compiled mode before that module could switch the interpreter
on (see its docstring); skipped when this session already runs the kernels in interpreter mode.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

KERNEL_TESTS = Path(__file__).with_name("test_draft_block_triton.py")


def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the kernel tests already run in this session's interpreter mode")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(KERNEL_TESTS)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "passed" in summary and "skipped" not in summary, summary
