"""`expertdesk pack`, `verify`, `check` end to end through app.cli.main."""

from __future__ import annotations

import json

import pytest

from app.cli import main
from expertpack import load_manifest
from pack_fixtures import write_deepseek4


@pytest.fixture
def src(tmp_path):
    return write_deepseek4(tmp_path / "src")


def test_help(capsys):
    for cmd in ("pack", "verify", "check"):
        with pytest.raises(SystemExit) as exc:
            main([cmd, "--help"])
        assert exc.value.code == 0
        out = capsys.readouterr().out
        assert cmd in out
    with pytest.raises(SystemExit):
        main(["pack", "--help"])
    out = capsys.readouterr().out
    assert "--delete-source" in out and "--overwrite" in out and "--buffered" in out


def test_pack_verify_check_end_to_end(src, tmp_path, capsys):
    out = tmp_path / "packs"
    assert main(["pack", str(src), "--out", str(out)]) == 0
    cap = capsys.readouterr()
    pack = out / "tiny-ds4.expertpack"
    assert str(pack) in cap.out and "quick verify" in cap.out
    assert "ETA" in cap.err  # the progress line
    assert load_manifest(pack).complete

    assert main(["verify", str(pack)]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["verify", str(pack), "--quick", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["quick"]

    # A damaged byte: exit 1 and the slice named.
    m = load_manifest(pack)
    with open(pack / "experts.bin", "r+b") as f:
        f.seek(m.block_offset(1, 2) + m.layers[1].role("down").offset)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    assert main(["verify", str(pack)]) == 1
    assert "blk.1 expert 2 role down" in capsys.readouterr().out

    code = main(["check", str(tmp_path), "--source", str(src), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == (0 if report["ok"] else 1)
    assert report["recommended"].keys() == {"cache_vram_mib", "cache_vram_reserve_mib", "host_cache_mib"}
    main(["check", str(tmp_path)])
    assert "free space" in capsys.readouterr().out


def test_errors_are_one_line_exit_2(src, tmp_path, capsys):
    out = tmp_path / "p.expertpack"
    assert main(["pack", str(src), "--out", str(out), "--buffered"]) == 0
    capsys.readouterr()
    assert main(["pack", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--overwrite" in err and "Traceback" not in err
    assert main(["pack", str(src), "--out", str(out), "--overwrite", "--delete-source"]) == 0
    assert not src.exists() and "source deleted" in capsys.readouterr().out

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(100))
    assert main(["pack", str(bad), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "not a GGUF file" in err and err.count("\n") == 1
    assert main(["verify", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["pack", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "x")]) == 2


def test_ctrl_c_cancels_cleanly(src, tmp_path, capsys, monkeypatch):
    """Ctrl+C in the main thread sets the cancel event; the build stops, exit 130, rerun resumes."""
    import threading

    import packer.builder as builder_mod

    real_run = builder_mod.PackBuilder.run

    def run_until_cancelled(self):
        assert self.cancel.wait(30), "the CLI never set the cancel event"
        return real_run(self)  # cancelled at its first group: BuildCancelled

    real_join = threading.Thread.join

    def join(self, timeout=None):
        if self.name == "expertdesk-pack" and timeout is not None:
            raise KeyboardInterrupt  # what the user's Ctrl+C does to the main thread
        return real_join(self, timeout)

    monkeypatch.setattr(builder_mod.PackBuilder, "run", run_until_cancelled)
    monkeypatch.setattr(threading.Thread, "join", join)
    out = tmp_path / "c.expertpack"
    assert main(["pack", str(src), "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert "cancelled" in err and "resume" in err and "Traceback" not in err
    assert not out.exists() and out.with_name(out.name + ".partial").exists()
    monkeypatch.undo()
    assert main(["pack", str(src), "--out", str(out)]) == 0
    assert main(["verify", str(out), "--quick"]) == 0
