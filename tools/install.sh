#!/usr/bin/env bash
# Install via-edge into a virtual environment, with llama-cpp-python built for this machine.
#
# llama-cpp-python ships as source only, and its vendored llama.cpp is built here with one of three
# flavors:
#   amx    x86-64 Linux CPUs with AMX (amx_int8 in /proc/cpuinfo): native flags, with the patch in
#          tools/patches/ applied to the vendored ggml AMX kernels. Unpatched, GCC 12 drops the tile
#          configuration's stores and the first multi-token decode on quantized weights dies with
#          SIGILL (llama.cpp #20824; docs/design.md, "The AMX build"). After the build a self-check
#          (tools/check_build.py) decodes through the AMX kernels in a subprocess and compares them
#          with the plain ones; if it crashes or disagrees, the install falls back to noamx.
#   noamx  native x86 SIMD without AMX (the fallback, and what earlier versions installed).
#   native llama.cpp's own default: everywhere else (Metal on macOS, other CPUs).
# Each wheel is built once into a cache folder named after the flavor, flags and patch, because pip's
# own wheel cache ignores CMAKE_ARGS.
#
# Environment: VENV (default .venv), PYTHON (default python3), VIA_EDGE_WHEEL_CACHE,
# VIA_EDGE_LLAMA_FLAVOR (amx | noamx | native; default detected), CMAKE_ARGS (extra flags, kept),
# VIA_EDGE_AMX_PATCH (the patch the amx flavor applies; default the one in tools/patches/).
set -euo pipefail

# shellcheck source=tools/llama_build.sh
source "$(dirname "${BASH_SOURCE[0]}")/llama_build.sh"

flavor="${VIA_EDGE_LLAMA_FLAVOR:-}"
if [ -z "$flavor" ]; then
  flavor=native
  if [ "$(uname -s)" = Linux ] && [ "$(uname -m)" = x86_64 ] && grep -qw amx_int8 /proc/cpuinfo; then
    flavor=amx
  fi
fi
case "$flavor" in
  amx|noamx|native) ;;
  *) echo "install.sh: VIA_EDGE_LLAMA_FLAVOR must be amx, noamx or native, not '$flavor'" >&2; exit 2 ;;
esac

build_wheel() {  # build a flavor's wheel into its cache folder unless it is there
  local fl="$1" wheels
  wheels="$(wheel_dir "$fl")"
  if ls "$wheels"/llama_cpp_python-"$llama_version"-*.whl >/dev/null 2>&1; then return 0; fi
  echo "install.sh: building llama-cpp-python $llama_version ($fl build; takes a few minutes, once)"
  rm -rf "$wheels.tmp" && mkdir -p "$wheels.tmp"
  local source="llama-cpp-python==$llama_version"
  if [ "$fl" = amx ]; then
    source="$(fetch_source amx "$wheels.tmp/sdist")" || { echo "install.sh: no patched amx source" >&2; return 1; }
  fi
  CMAKE_ARGS="$(flags_of "$fl")" "$venv/bin/python" -m pip wheel --no-deps --no-cache-dir \
    --no-binary llama-cpp-python -w "$wheels.tmp" "$source"
  rm -rf "$wheels.tmp/sdist" "$wheels" && mv "$wheels.tmp" "$wheels"
}

install_wheel() {  # put a flavor's llama-cpp-python into the venv, replacing whatever is there
  "$venv/bin/python" -m pip install -q --force-reinstall --no-deps --find-links "$(wheel_dir "$1")" \
    --only-binary llama-cpp-python "llama-cpp-python==$llama_version"
}

if [ -n "${VIA_EDGE_PRINT_WHEEL_DIR:-}" ]; then  # for tests: where a flavor's wheel is cached, then stop
  wheel_dir "$VIA_EDGE_PRINT_WHEEL_DIR"
  exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "install.sh: creating virtual environment $venv"
  "$python" -m venv "$venv"
fi

if [ "$flavor" = amx ] && ! build_wheel amx; then
  echo "install.sh: the amx build failed; falling back to the noamx build" >&2
  flavor=noamx
fi
[ "$flavor" = amx ] || build_wheel "$flavor"
install_wheel "$flavor"
echo "install.sh: installing via-edge (llama.cpp $flavor build from $(wheel_dir "$flavor"))"
"$venv/bin/python" -m pip install -q --find-links "$(wheel_dir "$flavor")" -e "$here[test,bench,serve]"

self_check="not run"
if [ "$flavor" = amx ]; then
  # In a subprocess of its own: a SIGILL from broken kernels must not take the installer down.
  if "$venv/bin/python" "$here/tools/check_build.py" --quiet; then
    self_check=passed
  else
    echo "install.sh: the AMX build failed its self-check (above); installing the noamx build instead" >&2
    flavor=noamx
    self_check="amx build failed, noamx installed"
    build_wheel noamx
    install_wheel noamx
  fi
fi
printf '{"flavor": "%s", "wheel": "%s", "self_check": "%s"}\n' "$flavor" "$(wheel_dir "$flavor")" "$self_check" \
  > "$venv/via-edge-build.json"
echo "install.sh: done (llama.cpp $flavor build). Try: $venv/bin/via-edge --help"
