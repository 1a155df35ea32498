"""Output files of the commands, checked before any work starts.

A command that runs for a minute and then cannot write its result has wasted the
minute, so `--stats-json`, `bench --json` and `logits --out` are resolved up front:
an existing folder (or a path ending in a separator) means "write the default file
name in there", a missing parent folder is created and the user is told so, and a
path that can never be written (a file in the way, no permission) is a usage error
naming the option, the problem and the fix. `write_atomically` then writes the file
through a temporary sibling, which is removed if the write fails.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO


class UsageError(ValueError):
    """A command-line value the user must change (printed as one line, exit status 2)."""


def output_file(given: str | os.PathLike[str], *, option: str, default_name: str,
                announce: Callable[[str], None] | None = None) -> Path:
    """The file `option` asks to write: `given`, or `given/default_name` for a folder.

    Creates a missing parent folder (and says so through `announce`, stderr by default);
    raises UsageError when the path can never be written.
    """
    text = os.fspath(given)
    if not text.strip():
        raise UsageError(f"{option} is empty: give a file name, or a folder to write {default_name} in")
    path = Path(text).expanduser()
    if path.is_dir() or text.endswith((os.sep, "/")):
        path = path / default_name
    if path.is_dir():
        raise UsageError(f"{option} {path}: that is a folder holding a folder named {default_name}; "
                         "give a file name instead")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{option} {path}: the file exists and is not writable; give another file name")
    parent = path.parent
    blocker = next((p for p in (parent, *parent.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise UsageError(f"{option} {path}: {blocker} is a file, not a folder; give another path")
    if not parent.exists():
        try:
            parent.mkdir(parents=True)
        except OSError as exc:
            raise UsageError(f"{option} {path}: cannot create the folder {parent} ({exc.strerror or exc}); "
                             "give a path in a folder you can write to") from None
        (announce or _to_stderr)(f"created folder {parent} for {option}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: the folder {parent} is not writable; give a path in a folder "
                         "you can write to")
    return path


def write_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write `path` through `.NAME.tmp` beside it; the temporary file never outlives a failure."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
