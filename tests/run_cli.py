"""Shared by the dflash-run tests: invoking the command, reading its --json output, building a tiny engine."""

from __future__ import annotations

import json

from click.testing import CliRunner

from trtllm_dflash.cli.run import main as run_main


def invoke(*args):
    return CliRunner().invoke(run_main, [str(a) for a in args])


def json_lines(result) -> tuple[list[dict], dict]:
    """--json output -> (per-prompt records, the summary object that comes last)."""
    *records, summary = [json.loads(line) for line in result.stdout.splitlines()]
    assert summary["summary"] is True and not any("summary" in r for r in records)
    return records, summary


def build_engine(tiny_pair, engine, *args):
    """dflash-build of the tiny pair into `engine`, which it returns."""
    from trtllm_dflash.cli.build import main as build_main

    target, drafter = tiny_pair
    built = CliRunner().invoke(build_main, ["--target", str(target), "--drafter", str(drafter), "-o", str(engine),
                                            "--profile", "cpu-reference", "--quiet", *map(str, args)])
    assert built.exit_code == 0, built.output
    return engine
