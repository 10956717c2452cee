"""The compiled CPU kernels build with -march=native, so a machine only ever compiles the branches of its own CPU.
These compile (no link, no run) both sources for other x86 CPUs: one without AVX2 (the target kernel once failed
to build there, round 24, and every CPU without AVX2 silently ran the torch path), and AVX-512 ones with and without
VNNI, BF16 and AMX, whose branches an AVX2 machine's rounds change without compiling them."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
CASES = [("target/cpu_kernel.cpp", "x86-64"), ("target/cpu_kernel.cpp", "sapphirerapids"),
         ("draft_block/cpu_kernel.cpp", "skylake-avx512"), ("draft_block/cpu_kernel.cpp", "sapphirerapids")]


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ here")
def test_both_kernels_compile_for_other_cpus():
    includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]

    def compile_for(case: tuple[str, str]) -> tuple[str, str, subprocess.CompletedProcess]:
        source, arch = case
        done = subprocess.run(["g++", "-std=c++17", "-O0", f"-march={arch}", "-fopenmp-simd", "-w",
                               "-DTORCH_EXTENSION_NAME=portability", "-DTORCH_API_INCLUDE_EXTENSION_H", *includes,
                               "-c", str(PLUGINS / source), "-o", "/dev/null"], capture_output=True, text=True,
                              timeout=600)
        return source, arch, done

    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f"{source} for -march={arch}:\n{done.stderr[-2000:]}"
                    for source, arch, done in pool.map(compile_for, CASES) if done.returncode != 0]
    assert not failures, "\n".join(failures)
