"""The built-in demo model: a tiny DeepSeek-V4 (`deepseek4`) that runs the whole path at once.

It is NOT a real model. It exists so a first run, a test or a machine without a big
GGUF can exercise everything for real: GGUF reading, the Expert Pack (built with
`packer.builder.build_pack`), SSD streaming through the expert cache, telemetry, the
byte-level BPE tokenizer (deepseek-v3 split rules), the DeepSeek-V4 chat format with
reasoning, sampling and the chat service.

Where it comes from: `resources/demo/expertdesk-demo.npz` holds every tensor already in
its GGUF type plus the GGUF metadata (vocabulary, merges, hyper-parameters). It was
trained once by `resources/demo/train_demo.py` (4 minutes on one H200; its loss
curve and its answers to fixed prompts lie beside it) on text that ships with Python:
standard-library docstrings and source, the language reference and the Zen of Python.
So it answers in recognisable English and writes Python that parses, pieced together
from that documentation; what it says is often wrong: ~13 M parameters know little, and
a few MB of text overfit them after about 5 passes (the shipped weights are those of
the lowest held-out loss, 3.66 nats per token). At first use `ensure_demo_pack` writes the
GGUF from that file and packs it into the user cache directory; both steps are
deterministic, so two machines produce byte-identical packs.

The cache directory is `$EXPERTDESK_HOME/demo` when that variable is set (tests), else
the platform's user cache directory (`platformdirs.user_cache_dir("ExpertDesk")/demo`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

DEMO_REF = "demo"
DEMO_MODEL_NAME = "ExpertDesk demo (tiny, not a real model)"
DEMO_CACHE_MIB = 3  # small on purpose: 36 of the 96 experts fit, so misses stream from the pack
WEIGHTS_FILE = "expertdesk-demo.npz"
GGUF_NAME = "expertdesk-demo.gguf"
PACK_NAME = "expertdesk-demo.expertpack"
_FORMAT = "expertdesk-demo-weights"

ProgressFn = Callable[[int, int, str], None]


class DemoModelError(RuntimeError):
    """The demo model could not be prepared (weights missing from this install, disk full, ...)."""


def is_demo_ref(model_ref: object) -> bool:
    """True when a model reference names the built-in demo (the word `demo`)."""
    return isinstance(model_ref, str) and model_ref.strip().lower() == DEMO_REF


def expertdesk_home() -> Path:
    """ExpertDesk's cache root: `$EXPERTDESK_HOME`, else the platform user cache directory."""
    override = os.environ.get("EXPERTDESK_HOME")
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("ExpertDesk", appauthor=False))


def weights_path() -> Path:
    """The shipped demo weights: `resources/demo/expertdesk-demo.npz` of a source/editable
    install, or its copy under `<prefix>/share/expertdesk/demo/` of a regular install."""
    from engine.resources import resource_path

    try:
        return resource_path(f"demo/{WEIGHTS_FILE}")
    except FileNotFoundError:  # demo_dir() turns the missing file into a DemoModelError
        return Path(__file__).resolve().parents[1] / "resources" / "demo" / WEIGHTS_FILE


def _weights_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def demo_dir(home: Path | None = None) -> Path:
    """Folder that holds the demo GGUF and pack for the shipped weights.

    The name carries the weights' digest, so new weights never reuse an old pack.
    """
    path = weights_path()
    if not path.is_file():
        raise DemoModelError(
            f"the demo model's weights {path} are missing from this installation, so the demo cannot be "
            "built; reinstall ExpertDesk from a complete source tree (or use a real GGUF/pack instead)"
        )
    return (home or expertdesk_home()) / "demo" / _weights_digest(path)[:16]


def load_demo_weights(path: Path | None = None) -> tuple[list, list[tuple[str, np.ndarray, int, list[int]]]]:
    """(metadata triples [key, value type, value], tensors [(name, raw, ggml type, shape)]) of the demo."""
    path = path or weights_path()
    with np.load(path, allow_pickle=False) as data:
        header = json.loads(bytes(data["header"]).decode("utf-8"))
        if header.get("format") != _FORMAT or header.get("version") != 1:
            raise DemoModelError(f"{path} is not an ExpertDesk demo weights file (version 1); reinstall ExpertDesk")
        tensors = [(name, data[f"t:{name}"], *header["tensors"][name]) for name in header["order"]]
    return header["metadata"], tensors


def write_demo_gguf(path: Path, weights: Path | None = None) -> Path:
    """Write the demo model as a `deepseek4` GGUF at `path` (same bytes every time)."""
    from gguf import GGUFValueType, GGUFWriter

    from engine.models.deepseek4_export import write_gguf_tensors

    metadata, tensors = load_demo_weights(weights)
    writer = GGUFWriter(str(path), "deepseek4")
    for key, kind, value in metadata:
        if kind.startswith("ARRAY_"):
            writer.add_key_value(key, value, GGUFValueType.ARRAY, GGUFValueType[kind[len("ARRAY_"):]])
        else:
            writer.add_key_value(key, value, GGUFValueType[kind])
    write_gguf_tensors(writer, ((name, raw, ggml_type) for name, raw, ggml_type, _shape in tensors))
    return path


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """Serialise demo builds of several processes (e.g. the app and a CLI run) on one machine."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: builds are rare and the final rename is atomic anyway
        yield
        return
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_demo_pack(home: Path | None = None, progress: ProgressFn | None = None) -> Path:
    """The demo's Expert Pack folder, built at first use (GGUF, then `build_pack`).

    progress(done, total, what) reports the build steps. Raises DemoModelError with
    what to do when the weights are missing or the build fails (e.g. disk full).
    """
    from expertpack import PackError, load_manifest
    from packer.builder import build_pack

    def built() -> bool:
        """A finished pack of this format (one of an older ExpertDesk is built again)."""
        try:
            load_manifest(pack)
        except PackError:
            return False
        return True

    folder = demo_dir(home)
    pack = folder / PACK_NAME
    if built():
        return pack
    report = progress or (lambda done, total, what: None)
    with _build_lock(folder):
        if built():  # another process built it while we waited
            return pack
        try:
            report(0, 2, "writing the demo GGUF")
            gguf_path = folder / GGUF_NAME
            tmp = folder / (GGUF_NAME + ".tmp")
            write_demo_gguf(tmp)
            os.replace(tmp, gguf_path)
            report(1, 2, "packing the demo's experts")
            build_pack(gguf_path, pack, overwrite=True)
            report(2, 2, "demo ready")
        except (OSError, PackError, ValueError) as exc:
            shutil.rmtree(pack, ignore_errors=True)
            raise DemoModelError(
                f"could not build the demo model in {folder}: {exc}. Free some disk space there, or set "
                "EXPERTDESK_HOME to a writable folder, and try again"
            ) from exc
    return pack
