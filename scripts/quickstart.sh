#!/usr/bin/env bash
# Set up (scripts/setup.sh) and open JupyterLab on the quickstart notebook: a live engine on the bundled
# SmolLM2-135M with its dashboard. Extra arguments go to `jupyter lab` (e.g. --port=8899).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export TOKENIZERS_PARALLELISM=false
root_flag=()
if [ "$(id -u)" = 0 ]; then root_flag=(--allow-root); fi
exec .venv/bin/jupyter lab --ip=127.0.0.1 --no-browser "${root_flag[@]}" "$@" examples/01_quickstart.ipynb
