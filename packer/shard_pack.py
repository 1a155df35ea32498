"""Pack a split GGUF while it downloads, shard by shard: peak disk use is the pack plus one shard.

    pack = ShardPacker(resolve(repo, "MXFP4_MOE/*.gguf"), "/mnt/ssd/packs").run()

A pack build needs every shard's header before it starts (the experts.bin layout and
dense.gguf's tensor table come from all of them), and the dense tensors are spread over
all shards. So:

1. Each shard's header and tensor table is fetched first with an HTTP Range request
   (growing until the whole header is in) and kept as a *stand-in*: a sparse file of
   the shard's real size holding only those header bytes. `GGUFSource.open` and the
   builder's `plan_pack` then plan the pack from the stand-ins with exactly the checks
   and arithmetic they apply to the complete files: the result is byte-identical to
   `build_pack` on the full set.
2. As each shard completes and is verified (`HubDownload.on_file`), its routed-expert
   slices are copied (and hashed) into experts.bin and its dense tensors into dense.gguf
   at their planned offsets; the files are fsynced, then `shard-progress.json` records
   the shard as done, and only then (unless `keep_shards`) is the shard deleted.
3. After the last shard the hashes, dense fingerprint and manifest are written as the
   builder writes them, the pack is verified and renamed to its final name.

A rerun after a crash or cancel skips the shards journaled done (they are not fetched
again) and redoes the others; a different source (other files on the hub) starts over.
A full disk keeps what is packed: the deleted shards could not be packed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from huggingface_hub import hf_hub_url
from huggingface_hub.utils import build_hf_headers, get_session

import expertpack as ep
from packer.builder import (
    BuildCancelled,
    dense_fingerprint,
    dense_layout,
    estimate_pack_bytes,
    pack_path_for,
    plan_pack,
)
from packer.diskio import MIB, allocated_bytes, format_bytes, free_space, is_disk_full, mount_point, space_margin
from packer.download import DownloadError, DownloadPlan, HubDownload, RemoteFile
from packer.errors import PackBuildError
from packer.gguf_source import GGUFFormatError, GGUFSource, read_header, split_set_paths
from packer.verify import CancelLike, ProgressFn, verify_manifest

__all__ = ["ShardPacker", "fetch_header", "pack_while_downloading"]

JOURNAL_NAME = "shard-progress.json"
STANDINS = "shard-headers"  # inside the partial pack: the header-only stand-ins
HEADER_FIRST = 4 * MIB  # first Range request per shard; doubled until the header is complete
COPY_CHUNK = 64 * MIB


def _fetch_prefix(plan: DownloadPlan, file: RemoteFile, nbytes: int, token: str | None) -> bytes:
    """The first `nbytes` of `file` (fewer at its end), through huggingface_hub's HTTP session."""
    url = hf_hub_url(plan.repo_id, file.path, revision=plan.commit, endpoint=plan.endpoint)
    headers = {**build_hf_headers(token=token), "Range": f"bytes=0-{nbytes - 1}"}
    out = bytearray()
    try:
        with get_session().stream("GET", url, headers=headers, follow_redirects=True) as r:
            r.raise_for_status()
            for chunk in r.iter_bytes():  # a server that ignores Range sends everything: stop early
                out += chunk
                if len(out) >= nbytes:
                    break
    except Exception as exc:  # httpx errors: refused, reset, 4xx/5xx
        raise DownloadError(f"{file.path}: could not read its header from {plan.endpoint} ({exc}); "
                            "check the network connection (and HF_ENDPOINT, if set) and run again") from None
    return bytes(out[:nbytes])


def fetch_header(plan: DownloadPlan, file: RemoteFile, standin: Path, token: str | None = None,
                 first: int = HEADER_FIRST) -> None:
    """Write `standin`: a sparse file of `file`'s size holding exactly its GGUF header bytes.

    A prefix of n bytes is parsed as the file it starts (zeros after it); the parse is
    exact when the data offset it finds is within the prefix, since the header and the
    tensor table end before it. Otherwise the prefix is doubled.
    """
    standin.parent.mkdir(parents=True, exist_ok=True)
    n = min(first, file.size)
    while True:
        prefix = _fetch_prefix(plan, file, n, token)
        _write_standin(standin, prefix, file.size)
        try:
            data_offset = read_header(standin).data_offset
        except GGUFFormatError:
            data_offset = None
        if data_offset is not None and data_offset <= len(prefix):
            _write_standin(standin, prefix[:data_offset], file.size)
            return
        if len(prefix) >= file.size:
            read_header(standin)  # the whole file and still no header: raise its format error
            raise GGUFFormatError(standin, "the header does not end inside the file", "re-download it")
        n = min(2 * n, file.size)


def _write_standin(path: Path, data: bytes, size: int) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.truncate(size)


@dataclass
class _Journal:
    path: Path
    fingerprint: str
    done: list[str] = field(default_factory=list)  # shard file names packed (and maybe deleted)
    # Shards this download fetched (in this run or an earlier one of the same pack): the
    # only ones it may delete. A shard that was already on disk (another tool's download
    # in the shared cache, the user's own file) is packed and left where it was.
    fetched: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> _Journal | None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(path, str(data["fingerprint"]), [str(x) for x in data["done"]],
                       [str(x) for x in data.get("fetched", [])])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"fingerprint": self.fingerprint, "done": self.done, "fetched": self.fetched}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        ep.fsync_dir(self.path.parent)


def _pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _pread_exact(fd: int, nbytes: int, offset: int, path: Path) -> bytes:
    data = os.pread(fd, nbytes, offset)
    if len(data) != nbytes:
        raise PackBuildError(f"{path}: ends at byte {offset + len(data)}, before its tensor data does; "
                             "the file changed after it was verified: run the same command again")
    return data


@dataclass
class ShardPacker:
    """Download `plan`'s split GGUF and pack it shard by shard into `out` (see the module doc).

    keep_shards keeps each shard after it is packed (default: delete it, so the disk
    holds the pack plus about one shard). `on_step(what, shard_name)` is called after
    each step ("downloaded", "packed", "deleted"), for progress and for tests that
    measure the disk. Other options as HubDownload's.
    """

    plan: DownloadPlan
    out: Path
    local_dir: Path | None = None
    cache_dir: Path | None = None
    token: str | None = None
    keep_shards: bool = False
    progress: ProgressFn | None = None
    cancel: CancelLike | None = None
    full_verify: bool = False
    on_step: Callable[[str, str], None] | None = None

    def __post_init__(self) -> None:
        self.shards = [f for f in self.plan.files if f.path.endswith(".gguf")]
        names = [Path(f.path).name for f in self.shards]
        if not names:
            raise PackBuildError(f"{self.plan.repo_id}: the chosen files hold no .gguf file; "
                                 "choose the model's files with --include")
        expected = [p.name for p in split_set_paths(names[0])]
        if sorted(names) != expected or len({Path(f.path).parent for f in self.shards}) != 1:
            raise PackBuildError(f"{self.plan.repo_id}: the chosen .gguf files ({', '.join(names)}) are not one "
                                 f"complete model ({', '.join(expected)}); choose one quantization with --include")
        self.shards.sort(key=lambda f: Path(f.path).name)
        self.names = expected
        self.final = pack_path_for(Path(names[0]), self.out)
        self.partial = self.final.with_name(self.final.name + ep.PARTIAL_SUFFIX)
        self.fingerprint = hashlib.sha256(json.dumps(
            [ep.FORMAT_VERSION, [(f.path, f.size, f.sha256 or f.blob_id) for f in self.shards]]).encode()).hexdigest()
        self.job = HubDownload(self.plan, local_dir=self.local_dir, cache_dir=self.cache_dir, token=self.token,
                               progress=self.progress, cancel=self.cancel, on_file=self._on_file,
                               skip=self._skip)
        self.shards_packed: list[str] = []  # shard names packed by this run
        self._fetched_seen = 0  # self.job.fetched_bytes at the last finished file
        self.journal = _Journal(self.partial / JOURNAL_NAME, self.fingerprint)  # replaced by run()

    # -- entry ------------------------------------------------------------------------------
    def run(self) -> Path:
        """Download and pack (or resume); return the final pack directory."""
        if self.final.exists():
            raise PackBuildError(f"{self.final} already exists; remove it or choose another folder")
        journal = self._open_partial()
        if journal is None:  # killed between marking the manifest complete and renaming
            return self._rename()
        self.journal = journal
        self._plan()
        if not self.keep_shards:
            for f in self.shards:
                name = Path(f.path).name
                if name in self.journal.done and name in self.journal.fetched:
                    self._delete(f)  # packed by a run that died before deleting it
        self._check_space()
        self.job.run()
        return self._finish()

    def _open_partial(self) -> _Journal | None:
        journal = _Journal.load(self.partial / JOURNAL_NAME) if self.partial.is_dir() else None
        if journal is not None and journal.fingerprint == self.fingerprint:
            return journal
        if self.partial.exists():
            if journal is None and self._complete_partial():
                return None
            shutil.rmtree(self.partial)  # another source, or an unreadable journal: start over
        self.partial.mkdir(parents=True)
        ep.fsync_dir(self.partial.parent)
        journal = _Journal(self.partial / JOURNAL_NAME, self.fingerprint)
        journal.save()
        return journal

    def _complete_partial(self) -> bool:
        try:
            manifest = ep.PackManifest.from_json((self.partial / ep.MANIFEST_NAME).read_text(encoding="utf-8"))
        except (OSError, ValueError, ep.PackError):
            return False
        names = [f.name for f in manifest.source_files]
        return (manifest.complete and names == self.names
                and verify_manifest(self.partial, manifest, quick=True).ok)

    # -- planning -----------------------------------------------------------------------------
    def _plan(self) -> None:
        """Plan from the header stand-ins (fetched once) exactly as build_pack plans from the files."""
        folder = self.partial / STANDINS
        for shard in self.shards:
            standin = folder / Path(shard.path).name
            if not (standin.is_file() and standin.stat().st_size == shard.size):
                fetch_header(self.plan, shard, standin, self.token)
        source = GGUFSource.open(folder / self.names[0])
        try:
            self.expert_plan, self.manifest, self.headers = plan_pack(source)
            self.manifest.validate(self.final)
            self.pack_bytes = estimate_pack_bytes(source, self.expert_plan)
            self.dense = [t for t in source.tensors.values() if t.name not in self.expert_plan.expert_tensor_names]
        finally:
            source.close()
        self.dense_header, self.dense_offsets, self.dense_size = dense_layout(self.headers, self.dense)
        if not self.journal.done:  # a new pack: the files at their final sizes, headers in place, gaps zero
            with open(self.partial / ep.EXPERTS_NAME, "wb") as f:
                f.truncate(self.manifest.experts_file_size)
                f.write(ep.experts_file_header(self.manifest))
            with open(self.partial / ep.HASHES_NAME, "wb") as f:
                f.truncate(self.manifest.hashes_file_size)
            with open(self.partial / ep.DENSE_NAME, "wb") as f:
                f.truncate(self.dense_size)
                f.write(self.dense_header)
            ep.fsync_dir(self.partial)

    def _check_space(self) -> None:
        todo = [f for f in self.shards if Path(f.path).name not in self.journal.done]
        largest = max((f.size for f in todo), default=0)
        need = self.pack_bytes + largest + space_margin(self.pack_bytes) - allocated_bytes(self.partial)
        free, _ = free_space(self.partial)
        if free < need:
            raise PackBuildError(
                f"not enough free space: packing while downloading needs the pack "
                f"({format_bytes(self.pack_bytes)}) plus one shard ({format_bytes(largest)}), "
                f"{format_bytes(free)} free on {mount_point(self.partial)}; free space or choose another folder")

    # -- per shard ----------------------------------------------------------------------------
    def _skip(self, file: RemoteFile) -> bool:
        return Path(file.path).name in self.journal.done

    def _on_file(self, path: Path) -> None:
        fetched = self.job.fetched_bytes > self._fetched_seen  # this file's bytes came over the network
        self._fetched_seen = self.job.fetched_bytes
        if path.name not in self.names:
            return  # a README or other file of the plan
        if fetched and path.name not in self.journal.fetched:
            self.journal.fetched.append(path.name)
            self.journal.save()
        self._step("downloaded", path.name)
        index = self.names.index(path.name)
        try:
            self._pack_shard(index, path)
        except OSError as exc:
            if is_disk_full(exc):
                raise PackBuildError(
                    f"the disk filled up while packing {path.name}: {len(self.journal.done)} of "
                    f"{len(self.names)} shards are packed and kept in {self.partial}; free "
                    f"{format_bytes(self.dense_size)} or more and run the same command again to go on") from None
            raise
        self.journal.done.append(path.name)
        self.journal.save()
        self.shards_packed.append(path.name)
        self._step("packed", path.name)
        if not self.keep_shards and path.name in self.journal.fetched:
            self._delete(self.shards[[Path(f.path).name for f in self.shards].index(path.name)])
            self._step("deleted", path.name)

    def _pack_shard(self, index: int, path: Path) -> None:
        """Copy shard `index`'s expert slices (hashed) and dense tensors to their planned offsets; fsync."""
        if read_header(path).sha256 != self.headers[index].sha256:
            raise PackBuildError(f"{path.name}: its header differs from the one fetched before the download "
                                 "(the repository changed?); run the same command again to start over")
        m, E = self.manifest, self.manifest.num_experts
        R = len(m.role_names)
        src = os.open(path, os.O_RDONLY)
        names = (ep.EXPERTS_NAME, ep.HASHES_NAME, ep.DENSE_NAME)
        fds = {name: os.open(self.partial / name, os.O_RDWR) for name in names}
        try:
            for li, layer in enumerate(self.expert_plan.layers):
                for r, (rp, re) in enumerate(zip(layer.roles, m.layers[li].roles)):
                    if rp.tensor.shard != index:
                        continue
                    self._check_cancel()
                    per = max(1, COPY_CHUNK // rp.nbytes)
                    for e0 in range(0, E, per):
                        k = min(per, E - e0)
                        data = memoryview(_pread_exact(src, k * rp.nbytes, rp.source_offset(e0), path))
                        for j in range(k):
                            piece = data[j * rp.nbytes : (j + 1) * rp.nbytes]
                            e = e0 + j
                            _pwrite_all(fds[ep.EXPERTS_NAME], piece, m.block_offset(li, e) + re.offset)
                            _pwrite_all(fds[ep.HASHES_NAME], m.slice_digest(li, e, r, piece),
                                        ((li * E + e) * R + r) * ep.DIGEST_SIZE)
            for t, at in zip(self.dense, self.dense_offsets):
                if t.shard != index:
                    continue
                self._check_cancel()
                for a in range(0, t.nbytes, COPY_CHUNK):
                    n = min(COPY_CHUNK, t.nbytes - a)
                    _pwrite_all(fds[ep.DENSE_NAME], _pread_exact(src, n, t.offset + a, path), at + a)
            for fd in fds.values():
                os.fsync(fd)
        finally:
            os.close(src)
            for fd in fds.values():
                os.close(fd)

    def _check_cancel(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise BuildCancelled("packing cancelled; run the same command again to resume it")

    def _delete(self, file: RemoteFile) -> None:
        """Remove a packed shard: the file (the cache's blob it links to, and the link)."""
        dest = self.job.destination(file)
        if dest.is_symlink() and self.local_dir is None:
            # The cache's snapshot link: its blob goes too, but only a blob of this repo's cache.
            blob, blobs = dest.resolve(), (self.job.root / "blobs").resolve()
            if blob.parent == blobs:
                blob.unlink(missing_ok=True)
        dest.unlink(missing_ok=True)  # in a local folder a link is removed, never what it points to
        ep.fsync_dir(dest.parent)

    def _step(self, what: str, name: str) -> None:
        if self.on_step is not None:
            self.on_step(what, name)

    # -- finish -------------------------------------------------------------------------------
    def _finish(self) -> Path:
        missing = [n for n in self.names if n not in self.journal.done]
        if missing:  # HubDownload.run returned without them: cannot happen unless skip lied
            raise PackBuildError(f"shards {', '.join(missing)} were not packed; run the same command again")
        dense = self.partial / ep.DENSE_NAME
        manifest = replace(self.manifest, hashes_sha256=ep.sha256_file(self.partial / ep.HASHES_NAME),
                           dense_sha256=ep.sha256_file(dense), **dense_fingerprint(dense))
        report = verify_manifest(self.partial, manifest, quick=not self.full_verify,
                                 check_dense_hash=self.full_verify)
        if not report.ok:
            self._forget_damaged(report.problems)
            raise PackBuildError(
                f"the new pack failed verification when read back ({report.problems[0].message}); "
                "run the same command again to fetch and pack the damaged parts again, and check the drive")
        shutil.rmtree(self.partial / STANDINS)
        ep.write_manifest(self.partial, replace(manifest, complete=True))
        (self.partial / JOURNAL_NAME).unlink()
        ep.fsync_dir(self.partial)
        return self._rename()

    def _forget_damaged(self, problems) -> None:
        """Un-journal the shards whose bytes failed verification, so a rerun fetches them again."""
        bad: set[int] = set()
        for p in problems:
            if p.block is not None:
                li = self.manifest.layer_index(p.block)
                bad |= {rp.tensor.shard for rp in self.expert_plan.layers[li].roles}
            elif p.kind == "dense":
                bad |= {t.shard for t in self.dense}
        self.journal.done = [n for n in self.journal.done if self.names.index(n) not in bad]
        self.journal.save()

    def _rename(self) -> Path:
        os.rename(self.partial, self.final)
        ep.fsync_dir(self.final.parent)
        return self.final


def pack_while_downloading(plan: DownloadPlan, out: str | os.PathLike, **options) -> Path:
    """Download `plan`'s split GGUF and pack it into `out` shard by shard; see ShardPacker."""
    return ShardPacker(plan, Path(out), **options).run()
