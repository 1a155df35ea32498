"""The command line as a new user meets it: output paths, bad values, messages, start-up time.

Every wrong argument is refused before any work starts, with exit status 2 and one
line naming the option, the problem and the fix; a folder given for an output file
means "the default file name in there"; messages speak in the options the user typed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from app.cli import main
from pack_fixtures import write_deepseek4

ROOT = Path(__file__).resolve().parents[1]


def test_stats_json_folder_and_a_rate_with_no_interval(demo_home, tmp_path, capsys):
    folder = tmp_path / "stats"
    folder.mkdir()
    assert main(["generate", "demo", "--prompt", "hi", "--max-tokens", "1", "--device", "cpu",
                 "--stats-json", str(folder)]) == 0
    err = capsys.readouterr().err
    record = json.loads((folder / "stats.json").read_text())
    assert record["stats"]["completion_tokens"] == 1
    assert "decode n/a" in err and "0.00 tok/s" not in err
    assert sorted(p.name for p in folder.iterdir()) == ["stats.json"]  # no .tmp left behind


def test_logits_of_the_demo_into_a_folder(demo_home, tmp_path, capsys):
    out = tmp_path / "emptydir"
    out.mkdir()
    assert main(["logits", "demo", "--tokens", "1,2,3", "--out", str(out), "--device", "cpu"]) == 0
    logits = np.load(out / "logits.npy")
    assert logits.shape[0] == 3 and logits.dtype == np.float32 and np.isfinite(logits).all()
    assert not (tmp_path / "emptydir.npy").exists()
    assert str(out / "logits.npy") in capsys.readouterr().out


@pytest.mark.parametrize("argv, option", [
    (["generate", "demo", "--prompt", "hi", "--stats-json", "{file}/stats.json"], "--stats-json"),
    (["bench", "demo", "--json", "{file}/run.json"], "--json"),
    (["logits", "demo", "--tokens", "1", "--out", "{file}/x.npy"], "--out"),
])
def test_unwritable_output_is_refused_before_any_work(argv, option, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main([a.replace("{file}", str(blocker)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert option in err and "is a file, not a folder" in err
    assert "[loading]" not in err and "[loaded]" not in err  # nothing ran


def test_missing_output_folder_is_created_and_said(tmp_path, capsys):
    from app.cli_paths import output_file

    target = output_file(tmp_path / "new" / "sub" / "f.json", option="--json", default_name="x.json")
    assert target == tmp_path / "new" / "sub" / "f.json" and target.parent.is_dir()
    assert f"created folder {target.parent}" in capsys.readouterr().err
    assert output_file(str(tmp_path / "new") + "/", option="--json", default_name="x.json") == \
        tmp_path / "new" / "x.json"


@pytest.mark.parametrize("command", [["generate", "demo", "--prompt", "hi"], ["chat", "demo"],
                                     ["bench", "demo"], ["serve", "demo"],
                                     ["logits", "demo", "--tokens", "1", "--out", "x.npy"]])
def test_bad_device_is_a_usage_error(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*command, "--device", "tpu"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--device" in err and "'tpu'" in err and "auto, cpu, cuda or cuda:N" in err
    assert "Traceback" not in err


def test_cache_size_must_be_a_whole_number(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "demo", "--prompt", "hi", "--cache-mib", "-5"])
    assert exc.value.code == 2 and "--cache-mib" in capsys.readouterr().err


def test_verify_and_check_name_what_was_given(tmp_path, capsys):
    gguf = write_deepseek4(tmp_path / "src")
    assert main(["verify", str(gguf)]) == 2
    err = capsys.readouterr().err
    assert "is a file, not an Expert Pack folder" in err and f"expertdesk pack {gguf}" in err
    assert main(["verify", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["check", str(gguf)]) == 2
    err = capsys.readouterr().err
    assert "DIR" in err and "is a file" in err and f"--source {gguf}" in err


def test_check_and_pack_speak_in_options(tmp_path, capsys):
    gguf = write_deepseek4(tmp_path / "src")
    main(["check", str(tmp_path), "--source", str(gguf)])
    out = capsys.readouterr().out
    recommended = next(line for line in out.splitlines() if line.startswith("recommended:"))
    assert "--cache-mib" in recommended and "--host-cache-mib" in recommended
    assert "cache_vram_mib" not in out and "direct_io" not in out
    packs = tmp_path / "new" / "packs"
    assert main(["pack", str(gguf), "--out", str(packs)]) == 0
    assert f"created folder {packs}" in capsys.readouterr().err
    assert main(["pack", str(gguf), "--out", str(packs)]) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=" not in err


def _modules_after(argv: list[str]) -> tuple[int, list[str]]:
    """Run `expertdesk ARGV` in a fresh interpreter; its exit code and the torch modules it imported."""
    code = ("import sys\nfrom app.cli import main\n"
            "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
            "print('MODULES', sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:5])\n"
            "sys.exit(rc)\n")
    result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    line = next(x for x in result.stdout.splitlines() if x.startswith("MODULES"))
    return result.returncode, eval(line.removeprefix("MODULES "))  # noqa: S307 - our own repr of a list


def test_commands_that_need_no_tensors_never_import_torch(tmp_path):
    gguf = write_deepseek4(tmp_path / "src")
    assert main(["pack", str(gguf), "--out", str(tmp_path)]) == 0
    assert _modules_after(["--help"]) == (0, [])
    assert _modules_after(["verify", "--quick", str(tmp_path / "tiny-ds4.expertpack")]) == (0, [])
