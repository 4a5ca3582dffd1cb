#!/usr/bin/env bash
# Set up (scripts/setup.sh --browser) and run the whole test suite, browser and notebook tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --browser
export TOKENIZERS_PARALLELISM=false
exec .venv/bin/pytest "$@"
