"""Publishing an output directory: everything is fsynced before the final name appears."""

from __future__ import annotations

from pathlib import Path

import pytest

from trtllm_dflash.checkpoints import publish
from trtllm_dflash.models.random_pair import save_random_target, tiny_target_config
from trtllm_dflash.quant.convert import convert_checkpoint


@pytest.fixture
def events(monkeypatch) -> list[tuple[str, Path]]:
    """Records ("fsync", path) and ("rename", destination) in order; both still really happen."""
    recorded: list[tuple[str, Path]] = []
    real_fsync, real_rename = publish.fsync_path, Path.rename

    def fsync_path(path: Path) -> None:
        recorded.append(("fsync", Path(path)))
        real_fsync(path)

    def rename(self: Path, target):
        recorded.append(("rename", Path(target)))
        return real_rename(self, target)

    monkeypatch.setattr(publish, "fsync_path", fsync_path)
    monkeypatch.setattr(Path, "rename", rename)
    return recorded


def tree(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*")} | {Path(".")}


def check_synced_before_named(events: list[tuple[str, Path]], work_paths: set[Path], work: Path, output: Path):
    final_rename = events.index(("rename", output))
    synced = {p.relative_to(work) for kind, p in events[:final_rename] if kind == "fsync" and p.is_relative_to(work)}
    assert synced >= work_paths, f"not fsynced before the rename: {sorted(map(str, work_paths - synced))}"
    assert ("fsync", output.parent) in events[final_rename:], "the new name itself was not made durable"


def test_publish_syncs_every_file_and_directory_before_the_swap(tmp_path, events):
    work, output = tmp_path / ".out.partial", tmp_path / "out"
    (work / "sub" / "deeper").mkdir(parents=True)
    (work / "config.json").write_text("{}")
    (work / "sub" / "deeper" / "shard.bin").write_bytes(b"\0" * 4096)
    output.mkdir()
    (output / "stale.txt").write_text("old")
    work_paths = tree(work)

    publish.publish_directory(work, output)

    check_synced_before_named(events, work_paths, work, output)
    assert tree(output) == work_paths and not work.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the old output is gone after the swap


def test_conversion_output_is_durable_before_it_is_named(tmp_path, events):
    src = save_random_target(tmp_path / "src", tiny_target_config(num_layers=2))
    output = tmp_path / "fp8"
    convert_checkpoint(src, output, "fp8", progress=False)

    last_rename = max(i for i, (kind, _) in enumerate(events) if kind == "rename")
    work = events[last_rename - 1][1]  # sync_tree ends with the work directory itself
    check_synced_before_named(events, tree(output), work, output)
