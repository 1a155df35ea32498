"""Test-wide settings: headless Qt and single-threaded torch (2-core CI machines)."""

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import torch  # noqa: E402

torch.set_num_threads(1)
