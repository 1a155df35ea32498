"""Download a model's GGUF files from the Hugging Face Hub: resumable, verified, cancellable.

    plan = resolve("unsloth/DeepSeek-V4-Flash-GGUF", include=["MXFP4_MOE/*"])
    paths = HubDownload(plan).run()

What `huggingface_hub` gives and this adds:

- the hub itself (`HfApi`: the commit a revision points to, the file listing with every
  LFS file's size and SHA-256), the URLs, headers and token (`hf_hub_url`,
  `build_hf_headers`, so `HF_TOKEN` and `huggingface-cli login` work) and the HTTP
  transfer (`http_get`, which resumes with a Range request after a dropped connection);
  `HF_ENDPOINT` (a mirror, or a test server) is read when a download starts;
- resume across runs and reboots: huggingface_hub 1.x+ deletes a partial file when a
  download fails, a 50 GB shard would start over. Here the bytes go to
  `NAME.expertdesk.incomplete` next to their destination and a rerun continues from
  its end with a Range request (after hashing what is there);
- verification: each file's SHA-256 (LFS files; git's blob SHA-1 for small ones) is
  computed while it is written and compared with the hub's listing; a mismatch deletes
  the file and fetches it again once; a rerun re-hashes a finished file whose size or
  modification time changed since it was verified, so a damaged file is fetched again;
- the standard cache: without `local_dir` files land in the Hugging Face cache layout
  (`HF_HUB_CACHE`, `HF_HOME`): `blobs/<sha256>`, `snapshots/<commit>/<path>` and
  `refs/<revision>`, so `huggingface_hub` itself (and llama.cpp's `-hf`) finds them;
- free space is checked before each file (a clear error, the partial file kept) and a
  full disk while writing says how much is missing; `cancel` stops at the next chunk.

Xet-backed repositories: when the hub answers with Xet metadata and `hf_xet` is installed,
the file is fetched by `hf_hub_download` (Xet's own chunk cache makes a rerun cheap),
then verified the same way.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import httpx2
from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.file_download import http_get, repo_folder_name
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import build_hf_headers, filter_repo_objects
from huggingface_hub.utils import tqdm as hf_tqdm
from huggingface_hub.utils._runtime import is_xet_available  # not re-exported in 2.x; file_download uses it

from packer.diskio import MIB, existing_ancestor, format_bytes, free_space, is_disk_full, mount_point
from packer.verify import CancelLike, ProgressFn, ProgressMeter

__all__ = ["DownloadCancelled", "DownloadError", "DownloadPlan", "HubDownload", "RemoteFile", "hub_cache_dir",
           "resolve"]

log = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".expertdesk.incomplete"
STATE_NAME = ".expertdesk-verified.json"  # per download root: files already verified (size, mtime, digest)
HASH_CHUNK = 8 * MIB
SPACE_MARGIN = 64 * MIB  # filesystem metadata, the state file


class DownloadError(RuntimeError):
    """A download that cannot go on; the message says why and what to do."""


class DownloadCancelled(Exception):
    """Cancelled by the user; the partial file stays and a rerun resumes it."""



def hub_endpoint() -> str:
    """HF_ENDPOINT as it is now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or hf_constants.ENDPOINT


def hub_cache_dir() -> Path:
    """The standard Hugging Face cache: HF_HUB_CACHE, else HF_HOME/hub, else huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path(hf_constants.HF_HUB_CACHE)


@dataclass(frozen=True)
class RemoteFile:
    """One file of the repository at the resolved commit, as the hub lists it."""

    path: str
    size: int
    sha256: str | None  # LFS files: the SHA-256 of the content
    blob_id: str  # git's blob SHA-1 (of "blob SIZE\\0" + content): checks small non-LFS files


@dataclass(frozen=True)
class DownloadPlan:
    repo_id: str
    revision: str
    commit: str
    files: tuple[RemoteFile, ...]
    endpoint: str

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


_HEX40 = re.compile(r"[0-9a-f]{40}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _checked_plan(plan: DownloadPlan) -> DownloadPlan:
    """The hub's listing is input from the network: refuse names that would leave the
    download folder (absolute, `..`, backslashes, empty parts) and ids that are not
    the hex digests they claim to be (they name cache folders and blob files)."""
    where = f"{plan.repo_id}@{plan.revision} (from {plan.endpoint})"
    if not _HEX40.fullmatch(plan.commit):
        raise DownloadError(f"{where}: the hub named commit {plan.commit!r}, not a 40-hex-digit id; "
                            "check HF_ENDPOINT: it may not be the Hugging Face hub")
    if (plan.revision.startswith("/") or "\\" in plan.revision
            or any(part in ("", ".", "..") for part in plan.revision.split("/"))):
        raise DownloadError(f"{where}: the revision {plan.revision!r} is not a branch, tag or commit name")
    for f in plan.files:
        parts = f.path.split("/")
        if f.path.startswith("/") or "\\" in f.path or any(part in ("", ".", "..") for part in parts):
            raise DownloadError(f"{where}: the hub listed a file named {f.path!r}, which would be written "
                                "outside the download folder; refusing it (check HF_ENDPOINT)")
        if f.sha256 is not None and not _HEX64.fullmatch(f.sha256) or not _HEX40.fullmatch(f.blob_id):
            raise DownloadError(f"{where}: the hub gave {f.path!r} a malformed digest; refusing it")
    return plan


def _inside(root: Path, path: Path) -> Path:
    """`path`, checked to lie under `root` once the links of its folders are resolved (a
    folder link planted in the target must not redirect a write elsewhere). The file
    itself may be a link (a user's own GGUF linked in): finished downloads replace a
    link rather than write through it, and a bad file's link is removed, not its target."""
    real_root = os.path.realpath(root)
    real = os.path.join(os.path.realpath(path.parent), path.name)
    if os.path.commonpath([real_root, real]) != real_root:
        raise DownloadError(f"{path} resolves to {real}, outside {root}; refusing to write there")
    return path


def _hub_error(repo_id: str, exc: Exception) -> DownloadError:
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status in (401, 403):
        fix = "set HF_TOKEN (or run `hf auth login`) with a token that may read it, and accept its license on the hub"
    elif status == 404:
        fix = "check the repository name and revision"
    else:
        fix = "check the network connection (and HF_ENDPOINT, if set) and run the same command again"
    first = (str(exc).strip().splitlines() or [exc.__class__.__name__])[0].rstrip(".")
    return DownloadError(f"{repo_id}: the hub answered {status or exc.__class__.__name__} ({first}); {fix}")


def resolve(repo_id: str, include: Sequence[str] | str | None = None, *, revision: str = "main",
            token: str | None = None, endpoint: str | None = None) -> DownloadPlan:
    """The files of `repo_id` at `revision` matching the `include` glob patterns (all without)."""
    endpoint = endpoint or hub_endpoint()
    api = HfApi(endpoint=endpoint, token=token)
    try:
        commit = api.model_info(repo_id, revision=revision).sha
        if commit is None:
            raise DownloadError(f"{repo_id}: the hub did not say which commit {revision!r} is; try again later")
        entries = [e for e in api.list_repo_tree(repo_id, recursive=True, revision=commit) if isinstance(e, RepoFile)]
    except HfHubHTTPError as exc:
        raise _hub_error(repo_id, exc) from None
    except (OSError, httpx2.TransportError) as exc:  # connection refused, DNS, timeouts: not always OSErrors
        raise _hub_error(repo_id, exc) from None
    patterns = [include] if isinstance(include, str) else list(include) if include else None
    chosen = list(filter_repo_objects(entries, allow_patterns=patterns, key=lambda e: e.path))
    if not chosen:
        pattern = ", ".join(patterns or [])
        raise DownloadError(f"{repo_id}@{revision}: no file matches {pattern or '(everything)'}; "
                            f"the repository has: {', '.join(sorted(e.path for e in entries)[:20])}")
    files = tuple(RemoteFile(e.path, e.size, e.lfs.sha256 if e.lfs else None, e.blob_id)
                  for e in sorted(chosen, key=lambda e: e.path))
    return _checked_plan(DownloadPlan(repo_id, revision, commit, files, endpoint))


class _Silent(hf_tqdm):
    """huggingface_hub's progress bar, switched off: progress goes through ProgressMeter."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


class _HashingWriter:
    """The file object http_get writes into: hashes every byte, counts progress, checks cancel.

    http_get rewinds and truncates when a server ignores a Range request (answers 200):
    then the hash restarts from what remains in the file.
    """

    def __init__(self, f: BinaryIO, file: RemoteFile, on_bytes: Callable[[int], None],
                 cancel: CancelLike | None) -> None:
        self.f = f
        self.file = file
        self.on_bytes = on_bytes
        self.cancel = cancel
        self.digest = _new_digest(file)
        self._rehash(f.tell())

    def _rehash(self, upto: int) -> None:
        self.digest = _new_digest(self.file)
        self.f.flush()
        with open(self.f.name, "rb") as r:
            left = upto
            while left > 0:
                chunk = r.read(min(HASH_CHUNK, left))
                if not chunk:
                    break
                self.digest.update(chunk)
                left -= len(chunk)

    def write(self, data: bytes) -> int:
        if self.cancel is not None and self.cancel.is_set():
            raise DownloadCancelled(f"download of {self.file.path} cancelled; run the same command again to resume")
        n = self.f.write(data)
        self.digest.update(data)
        self.on_bytes(len(data))
        return n

    def tell(self) -> int:
        return self.f.tell()

    def seek(self, pos: int, whence: int = 0) -> int:
        self._before_seek = self.f.tell()
        return self.f.seek(pos, whence)

    def truncate(self, size: int | None = None) -> int:
        n = self.f.truncate(size)
        self.on_bytes(self.f.tell() - getattr(self, "_before_seek", self.f.tell()))  # those bytes come again
        self._rehash(self.f.tell())
        return n


def _new_digest(file: RemoteFile) -> Any:
    if file.sha256:
        return hashlib.sha256()
    d = hashlib.sha1()  # git's blob id: the only checksum the hub gives for a non-LFS file
    d.update(f"blob {file.size}\0".encode())
    return d


def _expected(file: RemoteFile) -> str:
    return file.sha256 or file.blob_id


@dataclass
class HubDownload:
    """One run over a plan; `run()` returns the local paths in the plan's order.

    local_dir: put the files there (repo paths kept); without it, the standard cache.
    progress(done, total, rate, eta, phase) as the pack build reports it; `on_file(path)`
    is called after each file is complete and verified (pack while downloading uses it).
    """

    plan: DownloadPlan
    local_dir: Path | None = None
    cache_dir: Path | None = None
    token: str | None = None
    progress: ProgressFn | None = None
    cancel: CancelLike | None = None
    on_file: Callable[[Path], None] | None = None
    free_space_fn: Callable[[Path], tuple[int, int]] = free_space
    skip: Callable[[RemoteFile], bool] = field(default=lambda f: False)  # e.g. shards already packed and deleted
    max_attempts: int = 2

    def __post_init__(self) -> None:
        self.meter = ProgressMeter(self.progress, self.plan.total_bytes)
        self.fetched_bytes = 0  # bytes received from the network in this run
        self.refetched: list[str] = []  # files whose bytes did not match and were fetched again

    # -- where files go ---------------------------------------------------------------------
    @property
    def root(self) -> Path:
        if self.local_dir is not None:
            return Path(self.local_dir)
        return (self.cache_dir or hub_cache_dir()) / repo_folder_name(repo_id=self.plan.repo_id, repo_type="model")

    def destination(self, file: RemoteFile) -> Path:
        """Where the finished file is: local_dir/PATH, or the cache's snapshots/COMMIT/PATH."""
        if self.local_dir is not None:
            return _inside(self.root, self.root / file.path)
        return _inside(self.root, self.root / "snapshots" / self.plan.commit / file.path)

    def _storage(self, file: RemoteFile) -> Path:
        """The file's bytes: the destination itself, or the cache's blobs/<digest> it links to."""
        if self.local_dir is not None:
            return self.destination(file)
        return _inside(self.root, self.root / "blobs" / _expected(file))

    # -- verified-state record ----------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        try:
            return json.loads((self.root / STATE_NAME).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    def _remember(self, path: Path, file: RemoteFile) -> None:
        state = self._state()
        st = path.stat()
        state[_expected(file)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        tmp = self.root / (STATE_NAME + ".tmp")
        tmp.write_text(json.dumps(state, indent=1), encoding="utf-8")
        os.replace(tmp, self.root / STATE_NAME)

    def _known_good(self, path: Path, file: RemoteFile) -> bool:
        rec = self._state().get(_expected(file))
        try:
            st = path.stat()
        except OSError:
            return False
        if not isinstance(rec, dict):
            return False
        return rec.get("size") == st.st_size == file.size and rec.get("mtime_ns") == st.st_mtime_ns

    # -- the run --------------------------------------------------------------------------------
    def run(self) -> list[Path]:
        self.root.mkdir(parents=True, exist_ok=True)
        if self.local_dir is None:
            refs = self.root / "refs"
            refs.mkdir(exist_ok=True)
            if self.plan.revision != self.plan.commit:
                ref = _inside(self.root, refs / self.plan.revision)  # refs/pr/1 is a folder deep
                ref.parent.mkdir(parents=True, exist_ok=True)
                ref.write_text(self.plan.commit, encoding="utf-8")
        out = []
        for file in self.plan.files:
            if self.skip(file):
                self.meter.advance(file.size, f"{file.path}: already packed")
                out.append(self.destination(file))
                continue
            out.append(self._one(file))
            if self.on_file is not None:
                self.on_file(out[-1])
        self.meter.advance(0, "download complete")
        return out

    def _one(self, file: RemoteFile) -> Path:
        storage = self._storage(file)
        dest = self.destination(file)
        if not storage.is_file() and dest.is_file() and not dest.is_symlink():
            storage = dest  # a cache without symlinks (see _link) keeps the file in the snapshot
        if storage.is_file() and (self._known_good(storage, file) or self._check(storage, file)):
            self._link(storage, dest)
            self.meter.advance(file.size, f"{file.path}: already downloaded")
            return dest
        for attempt in range(self.max_attempts):
            got = self._fetch(file, storage)
            if got == _expected(file):
                self._remember(storage, file)
                self._link(storage, dest)
                return dest
            log.warning("%s: checksum %s, expected %s; fetching it again", file.path, got, _expected(file))
            self.refetched.append(file.path)
            storage.unlink(missing_ok=True)
            self.meter.advance(-file.size, f"{file.path}: damaged, fetching again")
            if attempt + 1 == self.max_attempts:
                raise DownloadError(
                    f"{file.path} arrived damaged {self.max_attempts} times (SHA-256 {got}, the hub says "
                    f"{_expected(file)}); check the network or proxy, or the drive ({mount_point(storage)})")
        raise AssertionError("unreachable")

    def _check(self, path: Path, file: RemoteFile) -> bool:
        """Re-hash a finished file found on disk; a damaged one is removed (and fetched again)."""
        if path.stat().st_size == file.size:
            d = _new_digest(file)
            with open(path, "rb") as f:
                while chunk := f.read(HASH_CHUNK):
                    d.update(chunk)
            if d.hexdigest() == _expected(file):
                self._remember(path, file)
                return True
        log.warning("%s on disk does not match the hub's checksum; fetching it again", path)
        self.refetched.append(file.path)
        path.unlink()
        return False

    def _fetch(self, file: RemoteFile, storage: Path) -> str:
        """Download into storage (resuming its .incomplete file); return the content's checksum."""
        partial = storage.with_name(storage.name + PARTIAL_SUFFIX)
        partial.parent.mkdir(parents=True, exist_ok=True)
        have = partial.stat().st_size if partial.exists() else 0
        if have > file.size:
            partial.unlink()
            have = 0
        need = file.size - have + SPACE_MARGIN
        free, _ = self.free_space_fn(existing_ancestor(partial.parent))
        if free < need:
            raise DownloadError(
                f"not enough free space for {file.path}: it needs {format_bytes(file.size - have)} more, "
                f"{format_bytes(free)} free on {mount_point(partial.parent)}; free space (what is already "
                "downloaded or packed is kept) and run the same command again")
        url = hf_hub_url(self.plan.repo_id, file.path, revision=self.plan.commit, endpoint=self.plan.endpoint)
        headers = build_hf_headers(token=self.token)
        if self._xet(url, file):
            return self._fetch_xet(file, storage)
        self.meter.advance(have, f"{file.path}: resuming at {format_bytes(have)}" if have else file.path)

        def count(n: int) -> None:
            self.fetched_bytes += max(0, n)
            self.meter.advance(n, file.path)

        try:
            with open(partial, "ab") as f:
                writer = _HashingWriter(f, file, count, self.cancel)
                http_get(url, writer, resume_size=have, headers=headers,  # type: ignore[arg-type]
                         expected_size=file.size, displayed_filename=file.path, tqdm_class=_Silent)
                f.flush()
                os.fsync(f.fileno())
        except DownloadCancelled:
            raise
        except OSError as exc:
            if is_disk_full(exc) or exc.errno == errno.EFBIG:
                free, _ = self.free_space_fn(existing_ancestor(partial.parent))
                raise DownloadError(
                    f"the disk filled up while downloading {file.path} ({format_bytes(partial.stat().st_size)} of "
                    f"{format_bytes(file.size)} kept, {format_bytes(free)} free on {mount_point(partial.parent)}); "
                    "free space and run the same command again to resume") from None
            raise DownloadError(f"downloading {file.path} failed: {exc}; run the same command again to resume"
                                ) from None
        except HfHubHTTPError as exc:
            raise _hub_error(self.plan.repo_id, exc) from None
        except httpx2.TransportError as exc:  # the connection lost for longer than http_get's own retries
            raise DownloadError(f"downloading {file.path} failed: {exc or type(exc).__name__}; check the network "
                                "connection and run the same command again to resume") from None
        os.replace(partial, storage)
        return str(writer.digest.hexdigest())

    def _xet(self, url: str, file: RemoteFile) -> bool:
        if not is_xet_available() or file.sha256 is None:
            return False
        try:
            meta = get_hf_file_metadata(url, token=self.token, endpoint=self.plan.endpoint)
        except HfHubHTTPError as exc:
            raise _hub_error(self.plan.repo_id, exc) from None
        return meta.xet_file_data is not None

    def _fetch_xet(self, file: RemoteFile, storage: Path) -> str:
        """Xet-backed file: huggingface_hub fetches it into a scratch folder; hash and move it."""
        scratch = self.root / ".expertdesk-xet"
        path = Path(hf_hub_download(self.plan.repo_id, file.path, revision=self.plan.commit, local_dir=scratch,
                                    endpoint=self.plan.endpoint, token=self.token))
        d = _new_digest(file)
        with open(path, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                d.update(chunk)
        self.meter.advance(file.size, file.path)
        self.fetched_bytes += file.size
        os.replace(path, storage)
        return str(d.hexdigest())

    def _link(self, storage: Path, dest: Path) -> None:
        """The cache's snapshot entry: a relative symlink to the blob (a copy where links are refused)."""
        if storage == dest:
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.is_symlink() or dest.exists():
            if dest.resolve() == storage.resolve():
                return
            dest.unlink()
        try:
            dest.symlink_to(os.path.relpath(storage, dest.parent))
        except OSError:  # Windows without developer mode: huggingface_hub keeps the file itself then
            os.replace(storage, dest)
