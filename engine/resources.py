"""Where the app's bundled files (demo weights, icon, desktop entry) are found.

In a source or editable install they sit in the repository's `resources/` and
`installer/` folders; a regular `pip install` copies them to `<prefix>/share/expertdesk/`
(see `[tool.setuptools.data-files]` in pyproject.toml).
"""

from __future__ import annotations

import sys
from pathlib import Path

_SOURCE_ROOT = Path(__file__).resolve().parents[1]
_INSTALLED_ROOT = Path(sys.prefix) / "share" / "expertdesk"


def resource_path(relative: str) -> Path:
    """Absolute path of a bundled file such as `"demo/expertdesk-demo.npz"`.

    Raises FileNotFoundError naming both places looked in when it is missing.
    """
    candidates = [
        _SOURCE_ROOT / "resources" / relative,
        _SOURCE_ROOT / "installer" / "linux" / relative,
        _INSTALLED_ROOT / relative,
    ]
    for path in candidates:
        if path.is_file():
            return path
    looked = ", ".join(str(p) for p in candidates)
    raise FileNotFoundError(
        f"bundled file {relative!r} is missing (looked in {looked}); reinstall ExpertDesk"
    )
