"""A build killed with SIGKILL at any stage leaves nothing that looks like an engine, and the
re-run finishes it, reusing the stages that were already done and verify."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from trtllm_dflash.engine.build import PAUSE_ENV, PAUSE_MARKER_ENV, build_engine
from trtllm_dflash.engine.plan import BuildOptions
from trtllm_dflash.engine.manifest import open_engine
from trtllm_dflash.errors import InputError

LAUNCH = "import sys; from trtllm_dflash.cli.build import main; sys.argv[0] = 'dflash-build'; main()"


def kill_at(stage: str, target, drafter, out, tmp_path) -> None:
    marker = tmp_path / f"paused-{stage}"
    env = {**os.environ, PAUSE_ENV: stage, PAUSE_MARKER_ENV: str(marker), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "--target", str(target), "--drafter", str(drafter),
                             "-o", str(out), "--profile", "cpu-reference", "--quiet"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not marker.exists():
        if proc.poll() is not None:
            pytest.fail(f"build exited before stage {stage}: {proc.stdout.read().decode()}")
        assert time.monotonic() < deadline, f"stage {stage} never reached"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("stage,reused", [
    ("drafter", ["target"]),
    ("manifest", ["target", "drafter"]),
    ("publish", ["target", "drafter"]),
])
def test_killed_build_leaves_no_engine_and_resumes(tiny_pair, tmp_path, stage, reused):
    target, drafter = tiny_pair
    out = tmp_path / "engine"
    kill_at(stage, target, drafter, out, tmp_path)
    assert not out.exists()
    with pytest.raises(InputError):
        open_engine(out)
    partial = tmp_path / ".engine.partial"
    assert partial.is_dir()
    if stage == "publish":  # the manifest is written, but under the temporary name only
        assert (partial / "manifest.json").is_file()
    logs: list[str] = []
    result = build_engine(BuildOptions(target, drafter, out), show_progress=False, log=logs.append)
    assert result.reused == reused and f"reused {reused[0]} (verified)" in logs
    open_engine(out, verify_checksums=True)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".engine")) == []


def test_damaged_stage_output_is_redone(tiny_pair, tmp_path):
    """A finished stage whose output changed since (e.g. truncated by a full disk) is not reused."""
    target, drafter = tiny_pair
    out = tmp_path / "engine"
    kill_at("manifest", target, drafter, out, tmp_path)
    weights = tmp_path / ".engine.partial" / "target" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    result = build_engine(BuildOptions(target, drafter, out), show_progress=False, log=lambda _: None)
    assert result.reused == ["drafter"] and result.built == ["target"]
    open_engine(out, verify_checksums=True)
