"""ExpertStore: byte-exact reads (direct and buffered), start-up refusals, read errors."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

from engine.runtime import ExpertReadError, ExpertStore, RuntimeStartError, split_ranges
from engine.runtime import staging as staging_mod
from engine.runtime import store as store_mod
from expertpack import ALIGNMENT, PackError, align_up
from pack_factory import Q4_0, GatedReads, make_pack, role_spec

O_DIRECT = getattr(os, "O_DIRECT", 0)
needs_o_direct = pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this OS")


@pytest.fixture
def pack(tmp_path):
    return make_pack(tmp_path / "tiny.expertpack", blocks=(1, 3, 4), num_experts=6, top_k=2)


def _all_experts(pack):
    for li, layer in enumerate(pack.manifest.layers):
        for e in range(pack.manifest.num_experts):
            yield li, layer.block, e


@pytest.mark.parametrize("direct_io", [pytest.param(True, marks=needs_o_direct), False])
@pytest.mark.parametrize("read_splits", [1, 3])
def test_every_expert_reads_back_byte_exact(pack, direct_io, read_splits):
    with ExpertStore(pack.path, direct_io=direct_io, read_splits=read_splits, io_threads=4, stage_slots=2) as store:
        for li, block, e in _all_experts(pack):
            assert bytes(store.read_expert(li, e).numpy()) == pack.block_bytes(block, e)
        snap = store.telemetry.snapshot()
    n = pack.manifest.num_layers * pack.manifest.num_experts
    assert snap["reads"] == n
    assert snap["pack_read_bytes"] == n * pack.manifest.layers[0].read_nbytes
    assert snap["direct_io"] is direct_io
    assert snap["buffered_reads"] == (0 if direct_io else n)  # buffered only when chosen, and counted
    assert snap["fallback_count"] == 0 and snap["io_errors"] == 0


def test_drive_busy_time_counts_overlapping_reads_once(pack, monkeypatch):
    # Each sub-read takes 50 ms; 3 in parallel are busy for ~50 ms, not 150 ms.
    real_preadv = os.preadv

    def slow_preadv(*args):
        time.sleep(0.05)
        return real_preadv(*args)

    monkeypatch.setattr(store_mod.os, "preadv", slow_preadv)
    with ExpertStore(pack.path, direct_io=False, read_splits=3, io_threads=3, stage_slots=1) as store:
        start = time.perf_counter()
        store.read_expert(0, 0)
        wall = time.perf_counter() - start
        snap = store.telemetry.snapshot()
    assert snap["read_seconds"] >= 0.15  # the sum over sub-reads
    assert 0.05 <= snap["drive_busy_seconds"] <= wall  # their union: within the call's wall time
    assert snap["drive_busy_seconds"] < snap["read_seconds"] - 0.04  # overlapping time counted once


def test_mixed_quant_layers_read_their_own_sizes(tmp_path):
    small = (role_spec("gate", 24, 256, Q4_0), role_spec("up", 24, 256, Q4_0), role_spec("down", 64, 96, Q4_0))
    pack = make_pack(tmp_path / "mixed.expertpack", blocks=(0, 1), layer_roles={1: small})
    sizes = [layer.read_nbytes for layer in pack.manifest.layers]
    assert sizes[1] < sizes[0] == pack.manifest.expert_stride
    with ExpertStore(pack.path, read_splits=2) as store:
        for li, block, e in _all_experts(pack):
            data = store.read_expert(li, e)
            assert data.numel() == sizes[li]
            assert bytes(data.numpy()) == pack.block_bytes(block, e)


def test_split_ranges_are_aligned_and_cover_the_block():
    for nbytes in (ALIGNMENT, 3 * ALIGNMENT, 13_369_344):
        for splits in (1, 2, 3, 4, 7, 1000):
            ranges = split_ranges(nbytes, splits)
            assert len(ranges) <= splits
            assert all(start % ALIGNMENT == 0 and length % ALIGNMENT == 0 for start, length in ranges)
            assert ranges[0][0] == 0 and sum(length for _, length in ranges) == nbytes
            assert all(a[0] + a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_staging_buffers_are_page_aligned(pack):
    with ExpertStore(pack.path, stage_slots=5) as store:
        for i in range(store.staging.count):
            assert store.staging.view(i).data_ptr() % ALIGNMENT == 0


# Start-up refusals -----------------------------------------------------------------
def test_misaligned_staging_buffer_is_refused(pack, monkeypatch):
    real = staging_mod.aligned_host_buffer

    def misaligned(nbytes, *, pinned=False):
        return real(nbytes + ALIGNMENT, pinned=pinned)[512 : 512 + align_up(nbytes)]

    monkeypatch.setattr(staging_mod, "aligned_host_buffer", misaligned)
    with pytest.raises(RuntimeStartError, match=r"staging buffer slot 0 at address .* not aligned to 4096"):
        ExpertStore(pack.path)


@needs_o_direct
def test_filesystem_rejecting_o_direct_at_open_is_refused(pack, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    with pytest.raises(RuntimeStartError) as exc:
        ExpertStore(pack.path)
    message = str(exc.value)
    assert f"the filesystem at {pack.path} does not support O_DIRECT" in message
    assert "ext4/xfs/btrfs/NTFS" in message and "--buffered-io" in message
    # The explicit buffered path still works on that filesystem.
    with ExpertStore(pack.path, direct_io=False) as store:
        assert bytes(store.read_expert(0, 0).numpy()) == pack.block_bytes(1, 0)


@needs_o_direct
def test_filesystem_rejecting_the_first_direct_read_is_refused(pack, monkeypatch):
    def einval(*args, **kwargs):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "preadv", einval)
    with pytest.raises(RuntimeStartError, match="does not support O_DIRECT"):
        ExpertStore(pack.path)


@needs_o_direct
@pytest.mark.skipif(not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK), reason="no /dev/shm")
def test_tmpfs_pack_is_either_read_exactly_or_refused_clearly():
    """tmpfs took no O_DIRECT before Linux 6.6: there the store must refuse, not fall back."""
    directory = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="expertdesk-test-"))
    try:
        pack = make_pack(directory / "tmpfs.expertpack", blocks=(0,), num_experts=3)
        try:
            store = ExpertStore(pack.path)
        except RuntimeStartError as exc:
            assert "does not support O_DIRECT" in str(exc) and "--buffered-io" in str(exc)
        else:
            with store:
                assert bytes(store.read_expert(0, 2).numpy()) == pack.block_bytes(0, 2)
                assert store.telemetry.get("fallback_count") == 0
        with ExpertStore(pack.path, direct_io=False) as store:
            assert bytes(store.read_expert(0, 1).numpy()) == pack.block_bytes(0, 1)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda m: dataclasses.replace(m, data_start=ALIGNMENT + 512), "data_start 4608 is not a multiple of 4096"),
        (lambda m: dataclasses.replace(m, expert_stride=m.expert_stride + 512), "expert_stride"),
        (
            lambda m: dataclasses.replace(
                m,
                layers=(
                    dataclasses.replace(
                        m.layers[0],
                        roles=(m.layers[0].roles[0], dataclasses.replace(m.layers[0].roles[1], offset=8192 + 100),
                               m.layers[0].roles[2]),
                    ),
                    *m.layers[1:],
                ),
            ),
            "role up starts at block offset 8292",
        ),
    ],
)
def test_misaligned_pack_offsets_are_refused(pack, monkeypatch, change, words):
    """The manifest validator refuses these too; the store checks again on its own."""
    monkeypatch.setattr(store_mod, "load_manifest", lambda path: change(pack.manifest))
    with pytest.raises(RuntimeStartError, match=words) as exc:
        ExpertStore(pack.path)
    assert "rebuild the pack" in str(exc.value)


def test_truncated_experts_file_is_refused(pack):
    path = pack.path / "experts.bin"
    os.truncate(path, path.stat().st_size - ALIGNMENT)
    with pytest.raises(RuntimeStartError, match="truncated"):
        ExpertStore(pack.path)


def test_missing_experts_file_is_refused_with_the_drive_hint(pack):
    (pack.path / "experts.bin").unlink()
    with pytest.raises(RuntimeStartError, match="missing.*drive is not connected"):
        ExpertStore(pack.path)


def test_foreign_header_is_refused(pack):
    with open(pack.path / "experts.bin", "r+b") as f:
        f.write(b"NOTAPACK")
    with pytest.raises(PackError, match="header"):
        ExpertStore(pack.path)


def test_incomplete_pack_is_refused(tmp_path):
    pack = make_pack(tmp_path / "p.expertpack", blocks=(0,), complete=False)
    with pytest.raises(PackError, match="not marked complete"):
        ExpertStore(pack.path)


# Read errors ---------------------------------------------------------------------
def _fail_next_read(monkeypatch, error):
    """Make the next os.preadv call fail (`error` raised, or its return value returned)."""
    real = os.preadv
    state = {"armed": True}

    def flaky(fd, buffers, offset, *args):
        if state["armed"]:
            state["armed"] = False
            if isinstance(error, BaseException):
                raise error
            return error
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", flaky)


@pytest.mark.parametrize(
    "error, words",
    [
        (OSError(errno.EIO, "Input/output error"), "I/O error reading expert 4 of blk.3"),
        (0, "short read of expert 4 of blk.3"),
        (OSError(errno.ENODEV, "No such device"), "disconnected or the file removed"),
    ],
)
def test_read_errors_raise_and_count_once(pack, monkeypatch, error, words):
    with ExpertStore(pack.path, direct_io=False) as store:
        _fail_next_read(monkeypatch, error)
        with pytest.raises(ExpertReadError, match=words) as exc:
            store.read_expert(1, 4)
        assert exc.value.block == 3 and exc.value.expert == 4
        assert store.telemetry.get("io_errors") == 1
        # The store stays usable and the next read is exact.
        assert bytes(store.read_expert(1, 4).numpy()) == pack.block_bytes(3, 4)
        assert store.telemetry.get("io_errors") == 1
        assert store.staging.free_count == store.staging.count


def test_deleted_pack_file_never_yields_garbage(pack):
    """Unlinking the file (or unplugging the drive) while running: the open descriptor
    still reads the right bytes or fails loudly; a restart says the file is missing."""
    with ExpertStore(pack.path) as store:
        (pack.path / "experts.bin").unlink()
        try:
            data = store.read_expert(2, 5)
        except ExpertReadError:
            pass
        else:
            assert bytes(data.numpy()) == pack.block_bytes(4, 5)
    with pytest.raises(RuntimeStartError, match="missing"):
        ExpertStore(pack.path)


def test_verify_on_read_catches_a_flipped_byte(pack):
    layer = pack.manifest.layers[0]
    offset = pack.manifest.block_offset(0, 2) + layer.roles[1].offset + 7
    with open(pack.path / "experts.bin", "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    with ExpertStore(pack.path, verify=True) as store:
        assert bytes(store.read_expert(0, 1).numpy()) == pack.block_bytes(1, 1)
        with pytest.raises(ExpertReadError, match="role up .* SHA-256"):
            store.read_expert(0, 2)
        assert store.telemetry.get("hash_mismatches") == 1


def test_many_reads_in_flight_at_once(pack):
    with ExpertStore(pack.path, read_splits=2, io_threads=8, stage_slots=8) as store:
        keys = [(li, e) for li, _b, e in _all_experts(pack)][:8]
        handles = [store.submit(li, e, store.staging.view(i)) for i, (li, e) in enumerate(keys)]
        for (li, e), handle in zip(keys, handles):
            block = pack.manifest.layers[li].block
            assert bytes(handle.result().numpy()) == pack.block_bytes(block, e)


def test_urgent_reads_go_ahead_of_queued_prefetch_reads(pack, monkeypatch):
    """An acquire's reads (urgent, the default) are served before prefetch reads
    (`urgent=False`) still queued, whenever they were submitted; each class in order."""
    import threading

    real_preadv, gate, arrived, order = os.preadv, threading.Event(), threading.Event(), []

    def gated(fd, buffers, offset, *args):
        arrived.set()
        gate.wait(10)
        order.append(offset)
        return real_preadv(fd, buffers, offset, *args)

    with ExpertStore(pack.path, read_splits=2, io_threads=1, stage_slots=4) as store:
        monkeypatch.setattr(store_mod.os, "preadv", gated)  # after the start-up probe's read
        later = [store.submit(0, e, store.staging.view(e), urgent=False) for e in (0, 1)]
        assert arrived.wait(10)  # the one reader holds expert 0's first sub-read at the gate
        urgent = [store.submit(0, e, store.staging.view(e)) for e in (2, 3)]
        gate.set()
        for e, handle in zip((0, 1, 2, 3), later + urgent):
            assert bytes(handle.result().numpy()) == pack.block_bytes(pack.manifest.layers[0].block, e)
    served = [(o - pack.manifest.block_offset(0, 0)) // pack.manifest.expert_stride for o in order]
    # Expert 3 was submitted behind 5 queued sub-reads, more than WHOLE_READS_BEHIND (4) for the
    # one reader thread: it went whole.
    assert served == [0, 2, 2, 3, 0, 1, 1], served


def test_a_read_behind_a_queue_that_feeds_every_reader_goes_whole(pack, monkeypatch):
    """Sub-reads are for experts that would leave reader threads idle: with 2 readers busy,
    the next expert is split (2 sub-reads queued: WHOLE_READS_BEHIND, here 1, per reader),
    the one after it goes whole; every byte is read exactly."""
    monkeypatch.setattr(store_mod, "WHOLE_READS_BEHIND", 1)
    base, stride = pack.manifest.block_offset(0, 0), pack.manifest.expert_stride
    nbytes = pack.manifest.layers[0].read_nbytes
    assert len(split_ranges(nbytes, 2)) == 2
    with ExpertStore(pack.path, read_splits=2, io_threads=2, stage_slots=4) as store:
        reads = GatedReads(monkeypatch)
        handles = [store.submit(0, 0, store.staging.view(0))]
        reads.wait_started(2)  # both readers hold a half of expert 0 at the gate
        handles += [store.submit(0, e, store.staging.view(e)) for e in (1, 2)]
        reads.gate.set()
        for e, handle in enumerate(handles):
            assert bytes(handle.result().numpy()) == pack.block_bytes(pack.manifest.layers[0].block, e)
    offsets = reads.wait_started(5)
    assert len(offsets) == 5
    per_expert = [sum(1 for o in offsets if (o - base) // stride == e) for e in range(3)]
    assert per_expert == [2, 2, 1]


@pytest.mark.parametrize("held_back", [True, False])
def test_a_prefetch_read_waits_until_no_urgent_read_is_in_flight(pack, monkeypatch, held_back):
    """`later_after_urgent` (default): a non-urgent read submitted while an urgent one is
    being read starts only once that one ends, and a reader holding such a read back takes
    an urgent read queued meanwhile. Off: the prefetch read starts beside the urgent one."""
    def experts(offsets):
        return [(o - pack.manifest.block_offset(0, 0)) // pack.manifest.expert_stride for o in offsets]

    monkeypatch.setattr(store_mod, "LATER_HOLD_S", 60.0)  # the bound on the hold: the next test
    with ExpertStore(pack.path, io_threads=2, stage_slots=4, later_after_urgent=held_back) as store:
        reads = GatedReads(monkeypatch)  # after the start-up probe's read
        first = store.submit(0, 2, store.staging.view(0))
        assert experts(reads.wait_started(1)) == [2]  # one reader is in the urgent read
        later = store.submit(0, 0, store.staging.view(1), urgent=False)  # the other reader takes it
        if held_back:
            time.sleep(0.2)  # the prefetch read must not start while the urgent one is in flight
            assert experts(reads.wait_started(1)) == [2]
            second = store.submit(0, 3, store.staging.view(2))  # taken by the reader holding one back
            assert experts(reads.wait_started(2)) == [2, 3]
        else:
            assert experts(reads.wait_started(2)) == [2, 0]
            second = store.submit(0, 3, store.staging.view(2))
        reads.gate.set()
        for e, handle in ((2, first), (0, later), (3, second)):
            assert bytes(handle.result().numpy()) == pack.block_bytes(pack.manifest.layers[0].block, e)
    assert experts(reads.wait_started(3)) == ([2, 3, 0] if held_back else [2, 0, 3])


@pytest.mark.parametrize("how", ["promoted", "held too long"])
def test_a_held_back_read_starts_beside_urgent_ones_when_promoted_or_held_too_long(pack, monkeypatch, how):
    """A held-back read is not starved: `promote` (an acquire waits for it) makes it urgent
    at once, and without that it waits at most LATER_HOLD_S for the urgent reads in flight."""
    hold = 60.0 if how == "promoted" else 0.05
    monkeypatch.setattr(store_mod, "LATER_HOLD_S", hold)
    base, stride = pack.manifest.block_offset(0, 0), pack.manifest.expert_stride
    with ExpertStore(pack.path, io_threads=2, stage_slots=4) as store:
        reads = GatedReads(monkeypatch)
        urgent = store.submit(0, 2, store.staging.view(0))
        reads.wait_started(1)
        queued_at = time.perf_counter()
        later = store.submit(0, 0, store.staging.view(1), urgent=False)
        if how == "promoted":
            store.promote(later)
            store.promote(later)  # once: its sub-read is already urgent (or started)
        offsets = reads.wait_started(2)  # starts while the urgent read is still in flight (at the gate)
        assert (offsets[1] - base) // stride == 0 and not reads.gate.is_set()
        if how == "held too long":
            assert reads.started[1][1] - queued_at >= hold
        reads.gate.set()
        for e, handle in ((2, urgent), (0, later)):
            assert bytes(handle.result().numpy()) == pack.block_bytes(pack.manifest.layers[0].block, e)


def test_submit_rejects_an_unaligned_buffer(pack):
    with ExpertStore(pack.path) as store:
        buffer = torch.empty(pack.manifest.expert_stride + ALIGNMENT, dtype=torch.uint8)
        shift = (-buffer.data_ptr()) % ALIGNMENT + 8
        with pytest.raises(ValueError, match="not an aligned"):
            store.submit(0, 0, buffer[shift:])


def _readers() -> set:
    import threading

    return {t for t in threading.enumerate() if t.name.startswith("expert-io")}


def test_reader_threads_finish_their_reads_then_stop_at_close(pack, monkeypatch):
    """close() waits for the sub-reads already queued (each one slow here), then its
    reader threads are gone; a store that never read started none."""
    before = _readers()
    idle = ExpertStore(pack.path, direct_io=False, io_threads=3)
    assert _readers() == before
    idle.close()
    real_preadv = os.preadv

    def slow_preadv(*args):
        time.sleep(0.02)
        return real_preadv(*args)

    monkeypatch.setattr(store_mod.os, "preadv", slow_preadv)
    store = ExpertStore(pack.path, direct_io=False, read_splits=3, io_threads=2, stage_slots=4)
    handles = [store.submit(0, e, store.staging.view(e)) for e in range(4)]
    assert 0 < len(_readers() - before) <= 2
    store.close()
    assert all(h.done() for h in handles)  # 12 sub-reads on 2 threads: all read before the stop
    for e, handle in enumerate(handles):
        assert bytes(handle.result().numpy()) == pack.block_bytes(pack.manifest.layers[0].block, e)
    assert _readers() == before
    with pytest.raises(RuntimeError, match="closed"):
        store.submit(0, 0, store.staging.view(0))


def test_reader_threads_stop_when_the_store_is_dropped_unclosed(pack):
    import gc

    store = ExpertStore(pack.path, direct_io=False, io_threads=2)
    store.read_expert(0, 1)
    threads = list(store._threads)
    assert threads and all(t.is_alive() for t in threads)
    del store
    gc.collect()
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_a_store_whose_read_failed_is_still_collected(pack, monkeypatch):
    """A failed sub-read's error (its traceback holds the store) is not kept by the reader
    thread while it waits for the next read: the unclosed store is collected, its readers stop."""
    import gc
    import weakref

    def failing(*args):
        raise OSError(errno.EIO, "Input/output error (injected)")

    store = ExpertStore(pack.path, direct_io=False, io_threads=1)
    monkeypatch.setattr(store_mod.platform_io, "pread_into", failing)
    with pytest.raises(ExpertReadError, match="I/O error"):
        store.read_expert(0, 0)
    threads, ref = list(store._threads), weakref.ref(store)
    del store
    gc.collect()
    assert ref() is None
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_a_submit_racing_close_is_refused_not_lost(pack, monkeypatch):
    """A read submitted from a reader thread (a prefetch started by a landed read) while
    close() stops the readers is refused with "closed", and close() returns."""
    import threading

    real_preadv = os.preadv

    def slow_preadv(*args):
        time.sleep(0.05)
        return real_preadv(*args)

    monkeypatch.setattr(store_mod.os, "preadv", slow_preadv)
    store = ExpertStore(pack.path, direct_io=False, io_threads=1, stage_slots=2)
    outcome: list[object] = []

    def again(_future):
        try:
            outcome.append(store.submit(0, 1, store.staging.view(1)))
        except RuntimeError as exc:
            outcome.append(exc)

    store.submit(0, 0, store.staging.view(0)).future.add_done_callback(again)
    closer = threading.Thread(target=store.close)
    closer.start()
    closer.join(timeout=10)
    assert not closer.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError) and "closed" in str(outcome[0])
