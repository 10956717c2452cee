"""One error type for bad input: it names the file, the field and what was expected.

The CLI turns it into a one-paragraph message and exit code 2 (never a traceback).
"""

from __future__ import annotations

from pathlib import Path


class InputError(Exception):
    """Input the toolkit cannot use: a checkpoint, config, prompt file or option that does not fit."""

    exit_code = 2

    def __init__(self, message: str, *, path: str | Path | None = None, field: str | None = None):
        self.path = None if path is None else str(path)
        self.field = field
        where = []
        if self.path:
            where.append(self.path)
        if field:
            where.append(f"field '{field}'")
        prefix = f"{': '.join(where)}: " if where else ""
        super().__init__(prefix + message)


class MissingDependencyError(Exception):
    """An optional dependency (TensorRT, TensorRT-LLM, Triton, a GPU) is not available here."""

    exit_code = 3

    def __init__(self, what: str, needed_for: str, hint: str = ""):
        self.what = what
        msg = f"{what} is required for {needed_for} but is not available on this machine."
        if hint:
            msg += f" {hint}"
        super().__init__(msg)
