"""dflash-build: validate a target/drafter pair (engine-directory writing comes with the build issue)."""

from __future__ import annotations

from pathlib import Path

import click

from trtllm_dflash.errors import InputError

from .common import clean_errors


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--target", "target_dir", type=click.Path(path_type=Path), required=True)
@click.option("--drafter", "drafter_dir", type=click.Path(path_type=Path), required=True)
@click.option("--check", is_flag=True, help="Validate only; write nothing.")
@clean_errors
def main(target_dir, drafter_dir, check):
    """Check that a gpt-oss target and a DFlash drafter fit together."""
    from trtllm_dflash.checkpoints.validate import validate_pair

    pair = validate_pair(target_dir, drafter_dir)
    if not check:
        raise InputError("writing engine directories is not implemented yet; only --check is available.",
                         field="--check")
    cfg = pair.drafter_config
    click.echo(f"ok: drafter ({cfg.num_hidden_layers} layers, block {cfg.block_size}, target layers "
               f"{cfg.target_layer_ids}) fits target {target_dir}")
