"""The one error of the pack format: a pack that cannot be used."""

from __future__ import annotations

import os
from pathlib import Path


class PackError(ValueError):
    """A pack that cannot be used. The message names the pack, the problem and the fix."""

    def __init__(self, path: str | os.PathLike, problem: str, fix: str = "") -> None:
        self.path = Path(path)
        self.problem = problem
        self.fix = fix
        message = f"{self.path}: {problem}"
        if fix:
            message += f" ({fix})"
        super().__init__(message)
