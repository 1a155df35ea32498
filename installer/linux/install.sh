#!/usr/bin/env bash
# ExpertDesk installer for Linux.
#
# Creates a virtual environment, installs the PyTorch build that fits this machine
# (CUDA for an NVIDIA driver new enough, CPU otherwise), installs ExpertDesk from this
# source tree, and adds a desktop entry with icon.
#
# Options (environment variables):
#   EXPERTDESK_VENV=DIR        where the environment goes (default ~/.local/share/expertdesk/venv)
#   EXPERTDESK_TORCH=SPEC      pip requirement for torch, skips detection (e.g. "torch==2.13.0")
#   EXPERTDESK_TORCH_INDEX=URL index for torch (default: chosen from the driver)
#   EXPERTDESK_NO_DESKTOP=1    skip the desktop entry
#   EXPERTDESK_EXTRAS=test     install extras too (the CI uses this)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
src="$(cd "$here/../.." && pwd)"
venv="${EXPERTDESK_VENV:-$HOME/.local/share/expertdesk/venv}"
python="${PYTHON:-python3}"

say() { printf 'expertdesk-install: %s\n' "$*"; }
die() { printf 'expertdesk-install: error: %s\n' "$*" >&2; exit 1; }

command -v "$python" >/dev/null || die "no $python found; install Python 3.10 or newer (e.g. apt install python3 python3-venv)"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || die "Python 3.10 or newer is needed; found $("$python" --version 2>&1)"
"$python" -c 'import venv, ensurepip' 2>/dev/null \
  || die "Python's venv module is missing; install it (e.g. apt install python3-venv) and run again"

# Which torch build: the CUDA wheel index that the NVIDIA driver supports, else CPU.
cuda_index_for_driver() {
  local major=$1
  if   [ "$major" -ge 580 ]; then echo cu130
  elif [ "$major" -ge 570 ]; then echo cu128
  elif [ "$major" -ge 560 ]; then echo cu126
  else echo ""; fi
}

torch_spec="${EXPERTDESK_TORCH:-torch}"
torch_index="${EXPERTDESK_TORCH_INDEX:-}"
if [ -z "${EXPERTDESK_TORCH:-}" ] && [ -z "$torch_index" ]; then
  if command -v nvidia-smi >/dev/null && driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1) && [ -n "$driver" ]; then
    flavour=$(cuda_index_for_driver "${driver%%.*}")
    if [ -n "$flavour" ]; then
      say "NVIDIA driver $driver found: installing the $flavour build of PyTorch"
      torch_index="https://download.pytorch.org/whl/$flavour"
    else
      say "NVIDIA driver $driver is too old for current PyTorch CUDA builds (needs 560+): installing the CPU build."
      say "Update the driver and run this installer again to use the GPU."
      torch_index="https://download.pytorch.org/whl/cpu"
    fi
  else
    say "no NVIDIA GPU found: installing the CPU build of PyTorch (ExpertDesk runs, slowly)"
    torch_index="https://download.pytorch.org/whl/cpu"
  fi
fi

say "creating the environment in $venv"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
if [ -n "$torch_index" ]; then
  "${pip[@]}" install --index-url "$torch_index" "$torch_spec"
else
  "${pip[@]}" install "$torch_spec"
fi
target="$src"
[ -n "${EXPERTDESK_EXTRAS:-}" ] && target="$src[${EXPERTDESK_EXTRAS}]"
"${pip[@]}" install "$target"

"$venv/bin/expertdesk" --version >/dev/null || die "the installed command does not start; see the messages above"
if [ -z "${EXPERTDESK_NO_DESKTOP:-}" ]; then
  "$venv/bin/expertdesk" --install-desktop-entry
fi
say "done. Start ExpertDesk from your applications menu or with: $venv/bin/expertdesk"
