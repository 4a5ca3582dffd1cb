#!/usr/bin/env bash
# The GPU device check (see scripts/gpu_check.py): results JSON + log under $OUT (or ./gpu_check_out).
cd "$(dirname "$0")/.." && exec python3 scripts/gpu_check.py --out "${OUT:-gpu_check_out}" "$@"
