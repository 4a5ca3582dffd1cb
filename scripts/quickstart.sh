#!/usr/bin/env bash
# Set up (scripts/setup.sh) and open JupyterLab on the quickstart notebook: a live engine on the bundled
# SmolLM2-135M with its dashboard. Extra arguments go to `jupyter lab` (e.g. --port=8899); JupyterLab listens on
# 127.0.0.1 unless one of them is an --ip (e.g. --ip=0.0.0.0 on a remote machine; see the README).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export TOKENIZERS_PARALLELISM=false
root_flag=()
if [ "$(id -u)" = 0 ]; then root_flag=(--allow-root); fi
ip_flag=(--ip=127.0.0.1)
for a in "$@"; do
  case "$a" in --ip|--ip=*|--ServerApp.ip|--ServerApp.ip=*) ip_flag=() ;; esac  # jupyter refuses two --ip
done
exec .venv/bin/jupyter lab "${ip_flag[@]}" --no-browser "${root_flag[@]}" "$@" examples/01_quickstart.ipynb
