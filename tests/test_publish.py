"""Publishing an output directory: everything is fsynced before the final name appears."""

from __future__ import annotations

from pathlib import Path

import pytest

from trtllm_dflash.checkpoints import publish
from trtllm_dflash.errors import InputError
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


def test_output_paths_are_checked_before_any_work(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    for path, directory, message in [
        (a_file, True, "expected a directory here, found a file"),
        (tmp_path, False, "expected a file here, found a directory"),
        (a_file / "engine", True, "notes.txt is a file, not a directory"),
        (a_file / "deeper" / "out.jsonl", False, "notes.txt is a file, not a directory"),
    ]:
        with pytest.raises(InputError, match=message) as caught:
            publish.check_output_path(path, "--output", directory)
        assert "--output" in str(caught.value) and str(path) in str(caught.value)
    publish.check_output_path(tmp_path / "new" / "nested" / "engine", "--output", directory=True)  # made later
    publish.check_output_path(a_file, "--output", directory=False)  # overwriting a file is allowed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # the write probe left nothing


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc, a folder that takes no new files")
def test_a_folder_that_takes_no_files_is_refused():
    with pytest.raises(InputError, match="does not accept new files"):
        publish.check_output_path(Path("/proc/trtllm-dflash-test/engine"), "--output", directory=True)
