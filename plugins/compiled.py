"""The project's compiled CPU kernels: C++ sources built on first use by torch's C++ extension loader.

A source is built (a C++ compiler and ninja, which this project's machines have) into a per-user cache,
once per source, CPU, torch installation and Python version, and takes a fraction of a second to load after that.
Where it cannot be built (no toolchain) or ``TRTLLM_DFLASH_CPU_KERNEL=0`` is set, `CompiledKernel.module()`
returns None and its caller runs its torch formulation; `unavailable_reason()` says why.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

DISABLE_VARIABLE = "TRTLLM_DFLASH_CPU_KERNEL"  # "0": every compiled CPU kernel off
AMX_VARIABLE = "TRTLLM_DFLASH_AMX"  # "0": no AMX tiles in any kernel (their AVX512 paths), e.g. for an A/B timing
PLUGINS = Path(__file__).parent  # its headers (vector_math.h, norms.h, each kernel's own) may be included by any source


@functools.cache
def cpu_flags() -> str:
    """The CPU's feature flags (the build uses -march=native, so a binary must not move to another CPU); read once
    a process (reading /proc/cpuinfo takes ~40 us)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def amx_wanted() -> bool:
    """Whether the kernels may use AMX tiles: unless TRTLLM_DFLASH_AMX=0 (the one place that reads it)."""
    return os.environ.get(AMX_VARIABLE, "1") != "0"


class CompiledKernel:
    """One C++ source (`source`) built as the extension module `prefix`_<digest>; `what` names it in messages;
    `on_load(module)`, if given, runs once the module is loaded (settings the module keeps)."""

    def __init__(self, source: Path, prefix: str, what: str, fallback: str,
                 on_load: Callable[[ModuleType], None] | None = None):
        self.source, self.prefix, self.what, self.fallback, self.on_load = source, prefix, what, fallback, on_load
        self.failure: str | None = None

    def build_name(self) -> str:
        # a build serves one CPU, torch installation and Python. The installation's path counts: torch's loader writes
        # its include paths into build.ninja, so two venvs sharing a directory rebuilt each other's kernel at every
        # switch (~20-30 s a kernel; CI's serve stage ran out of its start deadline so, round 35)
        key = [cpu_flags(), torch.__version__, str(Path(torch.__file__).parent), sys.implementation.cache_tag]
        headers = sorted(PLUGINS.rglob("*.h"))  # a change to any header rebuilds every kernel: simpler than tracking
        sources = self.source.read_bytes() + b"".join(h.read_bytes() for h in headers)  # which source includes which
        digest = hashlib.sha256(sources + "\n".join(key).encode()).hexdigest()
        return f"{self.prefix}_{digest[:12]}"

    def build_directory(self) -> Path:
        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
        directory = root / "trtllm_dflash" / self.build_name()
        directory.mkdir(parents=True, exist_ok=True)
        return directory

    @functools.cache
    def module(self) -> ModuleType | None:
        """The compiled module, or None where it is disabled or cannot be built."""
        if os.environ.get(DISABLE_VARIABLE, "1") == "0":
            self.failure = f"{DISABLE_VARIABLE}=0"
            return None
        try:
            from torch.utils.cpp_extension import load

            directory, name = self.build_directory(), self.build_name()
            # torch's loader marks a build with a `lock` file and waits, forever, while one exists: a build killed
            # mid-way (Ctrl-C in the first run's 20 s) left every later start hanging. Builds here first take an
            # flock, which the OS releases with its process, so a `lock` seen while holding it is a dead build's.
            with open(directory / "build.flock", "w") as guard:
                fcntl.flock(guard, fcntl.LOCK_EX)
                (directory / "lock").unlink(missing_ok=True)
                if not (directory / f"{name}.so").is_file():  # the one slow start a torch installation sees: say so
                    print(f"building the {self.what} in {directory} (once per torch installation, about 20 s)",
                          file=sys.stderr, flush=True)
                module = load(name, [str(self.source)], extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],
                              build_directory=str(directory), verbose=False)
        except Exception as exc:  # a missing compiler or ninja surfaces as RuntimeError, OSError, or a build error
            text = str(exc).strip()
            self.failure = f"{type(exc).__name__}: {text.splitlines()[-1] if text else exc}"
            warnings.warn(f"the {self.what} are unavailable ({self.failure}); {self.fallback}", RuntimeWarning,
                          stacklevel=2)
            return None
        if self.on_load is not None:
            self.on_load(module)
        return module

    def unavailable_reason(self) -> str | None:
        """Why `module()` returned None (None while it loads, or before it was asked)."""
        return self.failure
