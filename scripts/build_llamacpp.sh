#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-batched-bench for the bench's llama.cpp peer, and convert cbnb's own
# float32 SmolLM2-135M weights to an F32 GGUF, into cbnb's cache folder ($CBNB_CACHE_DIR, else ~/.cache/cbnb):
#   <cache>/llama.cpp/bin/llama-server, <cache>/llama.cpp/bin/llama-batched-bench,
#   <cache>/llama.cpp/smollm2-135m-f32.gguf
# Source: the llama.cpp that PyPI's llama-cpp-python sdist vendors (vendor/llama.cpp), built with -DGGML_NATIVE=ON,
# i.e. for this machine's CPU (its flags: AVX-512/AMX where present): copy the binaries to another CPU at your own
# risk. Idempotent: a step whose output exists is skipped. Not part of CI (15-40+ min on 2 cores).
# Needs cmake, a C++ compiler and network access to PyPI; the conversion needs `gguf` and `sentencepiece`
# importable by $PYTHON (default: .venv/bin/python, else python3), which it pip-installs when missing, and cbnb's
# converted model (run `python -c "import cbnb; cbnb.load_model('smollm2-135m')"` once, or the quickstart).
# Environment: CBNB_CACHE_DIR, PYTHON, LLAMACPP_PY_VERSION (default 0.3.36), JOBS (default: nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
version="${LLAMACPP_PY_VERSION:-0.3.36}"
cache="${CBNB_CACHE_DIR:-$HOME/.cache/cbnb}"
root="$cache/llama.cpp"
src="$root/src/llama_cpp_python-$version"
build="$root/build"
bin="$root/bin"
gguf_out="$root/smollm2-135m-f32.gguf"
model_dir="$cache/smollm2-135m"
jobs="${JOBS:-$(nproc)}"
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
mkdir -p "$root/src" "$bin"

if [ ! -d "$src/vendor/llama.cpp" ]; then
  echo "== downloading the llama-cpp-python==$version sdist"
  tmp="$(mktemp -d)"
  # --no-binary for this package alone: its build backend (scikit-build-core) may come as a wheel.
  "$PYTHON" -m pip download --no-deps --no-binary llama-cpp-python -d "$tmp" "llama-cpp-python==$version"
  tar -xzf "$tmp"/llama_cpp_python-"$version".tar.gz -C "$root/src"
  rm -rf "$tmp"
fi

if [ ! -x "$bin/llama-server" ] || [ ! -x "$bin/llama-batched-bench" ]; then
  echo "== building llama-server and llama-batched-bench (-DGGML_NATIVE=ON: for this machine's CPU)"
  cmake -S "$src/vendor/llama.cpp" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_OPENMP=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON
  cmake --build "$build" --target llama-server llama-batched-bench -j "$jobs"
  cp "$build/bin/llama-server" "$build/bin/llama-batched-bench" "$bin/"
fi

if [ ! -f "$gguf_out" ]; then
  if [ ! -f "$model_dir/model.safetensors" ]; then
    echo "cbnb's converted model is missing at $model_dir: run" \
      "\`$PYTHON -c \"import cbnb; cbnb.load_model('smollm2-135m')\"\` once, then this script again" >&2
    exit 1
  fi
  if ! "$PYTHON" -c "import gguf, sentencepiece" 2>/dev/null; then
    echo "== installing gguf and sentencepiece for the conversion"
    "$PYTHON" -m pip install gguf sentencepiece
  fi
  echo "== converting $model_dir to an F32 GGUF"
  # Prefer the vendored gguf-py (it matches the converter's version) over an installed one.
  PYTHONPATH="$src/vendor/llama.cpp/gguf-py${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" \
    "$src/vendor/llama.cpp/convert_hf_to_gguf.py" "$model_dir" --outtype f32 --outfile "$gguf_out.part"
  mv "$gguf_out.part" "$gguf_out"
fi
echo "== done: $bin/llama-server, $bin/llama-batched-bench, $gguf_out"
