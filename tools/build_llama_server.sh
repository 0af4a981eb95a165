#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` from the llama.cpp that the pinned llama-cpp-python vendors,
# with the flags (and, for amx, the patch) of the flavor tools/install.sh installed: the user's
# alternative on a CPU, on the same kernels, for `via-edge bench --peer llama-server` and
# `--peer llama-server-ngram`. Built once into the wheel cache (a few minutes), never per test run.
#
#   bash tools/build_llama_server.sh            # build (if not cached) and print the binary's path
#   bash tools/build_llama_server.sh --print    # print where it is or would be, build nothing
#
# Environment: as tools/install.sh (VENV, PYTHON, VIA_EDGE_WHEEL_CACHE, CMAKE_ARGS, VIA_EDGE_AMX_PATCH);
# VIA_EDGE_LLAMA_FLAVOR overrides the installed flavor (read from $VENV/via-edge-build.json).
set -euo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  ""|--print) ;;
  *) echo "build_llama_server.sh: unknown option '$1' (--print, --help)" >&2; exit 2 ;;
esac

# shellcheck source=tools/llama_build.sh
source "$(dirname "${BASH_SOURCE[0]}")/llama_build.sh"

flavor="${VIA_EDGE_LLAMA_FLAVOR:-}"
if [ -z "$flavor" ]; then
  if [ ! -f "$venv/via-edge-build.json" ]; then
    echo "build_llama_server.sh: no $venv/via-edge-build.json: run tools/install.sh first" >&2
    exit 2
  fi
  flavor="$("$python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["flavor"])' "$venv/via-edge-build.json")"
fi
case "$flavor" in
  amx|noamx|native) ;;
  *) echo "build_llama_server.sh: flavor must be amx, noamx or native, not '$flavor'" >&2; exit 2 ;;
esac

dest="$(wheel_dir "$flavor")-server"
binary="$dest/llama-server"
if [ "${1:-}" = --print ] || [ -x "$binary" ]; then
  echo "$binary"
  exit 0
fi

echo "build_llama_server.sh: building llama-server of llama-cpp-python $llama_version ($flavor build; a few minutes, once)" >&2
work="$dest.tmp"
rm -rf "$work" && mkdir -p "$work"
trap 'rm -rf "$work"' EXIT
source_dir="$(fetch_source "$flavor" "$work/sdist")"
# shellcheck disable=SC2046  # the flavor's flags are words
cmake -S "$source_dir/vendor/llama.cpp" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_OPENSSL=OFF $(flags_of "$flavor") >&2
cmake --build "$work/build" --target llama-server -j "$(nproc)" >&2
mkdir -p "$work/out"
cp "$work/build/bin/llama-server" "$work/out/llama-server"
rm -rf "$dest" && mv "$work/out" "$dest"
echo "$binary"
