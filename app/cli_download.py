"""`expertdesk fit` and `expertdesk download`: which model fits this PC, and fetching it from the hub.

Exit statuses as the other pack commands (app.cli_pack): 0 success, 1 does not fit,
2 an error the user must fix (one line on stderr), 130 cancelled with Ctrl+C.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading

from app.cli_pack import EXIT_CANCELLED, EXIT_ERROR, EXIT_OK, EXIT_PROBLEMS, ProgressBar, run_with_ctrl_c
from packer.diskio import format_bytes


def _catalog():
    from engine.resources import resource_path
    from packer.fit import load_catalog

    return load_catalog(resource_path("catalog.json"))


# --- fit -----------------------------------------------------------------------------------


def _add_fit(p: argparse.ArgumentParser) -> None:
    p.add_argument("release", nargs="?", metavar="RELEASE",
                   help="a release id or repo from the catalogue (default: every release)")
    p.add_argument("--dir", default=".", metavar="DIR", help="the folder the pack would go in (default: here)")
    p.add_argument("--probe-seconds", type=float, default=2.0, metavar="S",
                   help="how long the drive read probe runs (default 2)")
    p.add_argument("--probe-mib", type=int, default=256, metavar="MIB",
                   help="size of the scratch file the probe writes and reads (default 256)")
    p.add_argument("--json", action="store_true", help="print the reports as JSON on stdout")


def _run_fit(args: argparse.Namespace) -> int:
    """Estimate, for each release, disk, VRAM/RAM budgets and decode tokens/s on this PC."""
    from packer.fit import CatalogError, estimate_fit, find_release, probe_read_speed

    try:
        releases = _catalog()
        chosen = [find_release(releases, args.release)] if args.release else releases
        probe = probe_read_speed(args.dir, seconds=args.probe_seconds, file_bytes=args.probe_mib << 20)
        reports = [estimate_fit(r, args.dir, read_probe=probe) for r in chosen]
    except (CatalogError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as exc:
        print(f"error: cannot measure {args.dir}: {exc.strerror or exc}; choose an existing, writable folder",
              file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=1))
    else:
        for r in reports:
            print("\n".join(r.lines()))
    return EXIT_OK if all(r.ok for r in reports) else EXIT_PROBLEMS


# --- download ------------------------------------------------------------------------------


def _add_download(p: argparse.ArgumentParser) -> None:
    p.add_argument("repo", metavar="REPO", help="a Hugging Face model repository (org/name) or a catalogue release id")
    p.add_argument("--include", action="append", metavar="PATTERN",
                   help="download only files matching this glob (repeatable; default: the release's files, "
                        "or everything)")
    p.add_argument("--revision", default="main", help="branch, tag or commit (default: main)")
    p.add_argument("--local-dir", metavar="DIR",
                   help="put the files in DIR instead of the Hugging Face cache (HF_HUB_CACHE / HF_HOME)")
    p.add_argument("--pack", metavar="OUT",
                   help="pack the split GGUF into an Expert Pack in OUT while it downloads, shard by shard, "
                        "deleting each shard once packed (peak disk: the pack plus about one shard)")
    p.add_argument("--keep-shards", action="store_true", help="with --pack: keep the shards after packing them")


def _run_download(args: argparse.Namespace) -> int:
    """Resolve, download and verify; a rerun resumes and re-verifies."""
    from packer.builder import BuildCancelled, PackBuildError
    from packer.download import DownloadCancelled, DownloadError, HubDownload, resolve
    from packer.fit import CatalogError, find_release
    from packer.gguf_source import GGUFFormatError

    repo, include = args.repo, args.include
    if "/" not in repo:
        try:
            release = find_release(_catalog(), repo)
        except (CatalogError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_ERROR
        repo, include = release.repo, include or [release.include]
    bar = ProgressBar()

    cancel = threading.Event()

    def work():
        plan = resolve(repo, include, revision=args.revision)
        if args.pack:
            return _pack_while_downloading(plan, args, bar, cancel)
        job = HubDownload(plan, local_dir=args.local_dir, progress=bar, cancel=cancel)
        return plan, job, job.run()

    value, error = run_with_ctrl_c(work, cancel, bar, "cancelling (the partial file is kept)...",
                                   "expertdesk-download")
    if isinstance(error, DownloadCancelled):
        print(f"cancelled: {error}", file=sys.stderr)
        return EXIT_CANCELLED
    if isinstance(error, DownloadError | PackBuildError | GGUFFormatError):
        print(f"error: {error}", file=sys.stderr)
        return EXIT_ERROR
    if isinstance(error, BuildCancelled):
        print(f"cancelled: {error}", file=sys.stderr)
        return EXIT_CANCELLED
    if error is not None:
        raise error
    plan, job, paths = value
    print(f"downloaded {len(plan.files)} files of {plan.repo_id}@{plan.commit[:12]} "
          f"({format_bytes(plan.total_bytes)}, {format_bytes(job.fetched_bytes)} fetched this run"
          + (f", {len(job.refetched)} damaged and fetched again" if job.refetched else "")
          + "; SHA-256 verified)")
    for p in paths:
        print(p)
    return EXIT_OK


def _pack_while_downloading(plan, args: argparse.Namespace, bar, cancel: threading.Event):
    """`download --pack`: packer.shard_pack, reported like a plain download (the path is the pack's)."""
    from pathlib import Path

    from packer.shard_pack import ShardPacker

    packer = ShardPacker(plan, Path(args.pack), local_dir=args.local_dir, keep_shards=args.keep_shards,
                         progress=bar, cancel=cancel)
    return plan, packer.job, [packer.run()]


COMMANDS = [
    ("fit", "which catalogue model fits this PC: disk, VRAM, RAM, expected decode tokens/s (drive probe)",
     _add_fit, _run_fit),
    ("download", "download a model's GGUF files from Hugging Face (resumes, verifies SHA-256)",
     _add_download, _run_download),
]
