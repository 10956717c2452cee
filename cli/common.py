"""What every command shares: turning known errors into one clear paragraph and an exit code."""

from __future__ import annotations

import atexit
import functools
import signal
import sys
from collections.abc import Callable

import click
import torch

from trtllm_dflash.errors import InputError, MissingDependencyError


EXIT_INTERRUPTED = 130  # the shell convention for SIGINT


def clean_errors(command: Callable) -> Callable:
    """Bad input exits 2, a missing optional dependency 3 and a failed file operation 1, each with a
    message naming what failed, never a traceback; Ctrl-C outside the part of a command that reports what it
    had done (dflash-run's loop) exits 130 with one line, where click would say "Aborted!" and exit 1."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        ignore_interrupts_at_exit()
        try:
            return command(*args, **kwargs)
        except (InputError, MissingDependencyError) as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except OSError as exc:  # the file system said no (disk full, permissions): say where, exit 1
            where = ": ".join(str(name) for name in (exc.filename, exc.filename2) if name)
            click.echo(f"error: {where + ': ' if where else ''}{exc.strerror or exc}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)

    return wrapper


@functools.cache
def ignore_interrupts_at_exit() -> None:
    """Ctrl-C once the interpreter exits is ignored: the command has reported, and a KeyboardInterrupt in torch's
    exit hooks printed a traceback after it (round 33). Registered after torch's (at its import), so it runs first."""
    atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)


def parse_ints(text: str, option: str, least: int) -> list[int]:
    """'1,2,4' -> [1, 2, 4], sorted and deduplicated; each at least `least`."""
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise InputError(f"expected comma-separated integers, got {text!r}.", field=option) from None
    if not values or values[0] < least:
        raise InputError(f"expected integers >= {least}, got {text!r}.", field=option)
    return values


def resolve_device(device: str) -> torch.device:
    """auto, cpu, cuda or cuda:N (the devices the reference runtime supports)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind, colon, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (colon and (kind == "cpu" or not index.isdigit())):
        raise InputError(f"expected auto, cpu, cuda or cuda:N, got {device!r}.", field="--device")
    if kind == "cuda" and not torch.cuda.is_available():
        raise InputError("CUDA was asked for but no CUDA device is available here.", field="--device")
    if index and int(index) >= torch.cuda.device_count():
        raise InputError(f"this machine has {torch.cuda.device_count()} CUDA device(s); {device} is not one.",
                         field="--device")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """fp32 on CPU (exact and fast enough for small models), bf16 on GPUs."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
