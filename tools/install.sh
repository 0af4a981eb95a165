#!/usr/bin/env bash
# Install via-edge into a virtual environment, with llama-cpp-python built for this machine.
#
# llama-cpp-python ships as source only. Its default build uses -march=native, which on x86-64 CPUs
# with AMX (amx_int8) enables ggml's AMX weight buffers; any multi-token llama_decode with quantized
# weights then segfaults (llama.cpp #20824), and speculative verification always decodes several
# tokens. On such machines we build without AMX; everywhere else (Metal on macOS, other CPUs) the
# native build is kept. The wheel is built once per flag set into a cache folder named after it,
# because pip's own wheel cache ignores CMAKE_ARGS.
#
# Environment: VENV (default .venv), PYTHON (default python3), VIA_EDGE_WHEEL_CACHE,
# VIA_EDGE_LLAMA_FLAVOR (native | noamx; default detected), CMAKE_ARGS (extra flags, kept).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$here/.venv}"
python="${PYTHON:-python3}"
llama_version="0.3.36"
cache="${VIA_EDGE_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/via-edge/wheels}"

noamx_flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \
-DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"

flavor="${VIA_EDGE_LLAMA_FLAVOR:-}"
if [ -z "$flavor" ]; then
  flavor=native
  if [ "$(uname -s)" = Linux ] && [ "$(uname -m)" = x86_64 ] && grep -qw amx_int8 /proc/cpuinfo; then
    flavor=noamx
  fi
fi
case "$flavor" in
  native) flags="${CMAKE_ARGS:-}" ;;
  noamx) flags="$noamx_flags ${CMAKE_ARGS:-}" ;;
  *) echo "install.sh: VIA_EDGE_LLAMA_FLAVOR must be native or noamx, not '$flavor'" >&2; exit 2 ;;
esac
tag="$flavor-$(printf '%s|%s|%s' "$flags" "$(uname -sm)" "$("$python" -c 'import sys; print(sys.version_info[:2])')" | sha256sum | cut -c1-12)"
wheels="$cache/llama-cpp-python-$llama_version-$tag"

if [ ! -x "$venv/bin/python" ]; then
  echo "install.sh: creating virtual environment $venv"
  "$python" -m venv "$venv"
fi

if ! ls "$wheels"/llama_cpp_python-"$llama_version"-*.whl >/dev/null 2>&1; then
  echo "install.sh: building llama-cpp-python $llama_version ($flavor build; takes a few minutes, once)"
  mkdir -p "$wheels.tmp"
  CMAKE_ARGS="$flags" "$venv/bin/python" -m pip wheel --no-deps --no-cache-dir --no-binary llama-cpp-python \
    -w "$wheels.tmp" "llama-cpp-python==$llama_version"
  rm -rf "$wheels" && mv "$wheels.tmp" "$wheels"
fi

echo "install.sh: installing via-edge (llama.cpp $flavor build from $wheels)"
"$venv/bin/python" -m pip install -q --find-links "$wheels" --only-binary llama-cpp-python \
  "llama-cpp-python==$llama_version"
"$venv/bin/python" -m pip install -q --find-links "$wheels" -e "$here[test,bench,serve]"
echo "install.sh: done. Try: $venv/bin/via-edge --help"
