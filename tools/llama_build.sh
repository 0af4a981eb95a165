# Sourced by tools/install.sh and tools/build_llama_server.sh: the pinned llama-cpp-python, its build
# flavors' CMake flags and cache folders, and its source (patched for the amx flavor). One definition,
# so the llama-server peer is built exactly as the llama.cpp that via-edge runs.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$here/.venv}"
python="${PYTHON:-python3}"
llama_version="0.3.36"
cache="${VIA_EDGE_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/via-edge/wheels}"
amx_patch="${VIA_EDGE_AMX_PATCH:-$here/tools/patches/llama-cpp-python-$llama_version-amx-tile-config.patch}"

noamx_flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \
-DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"

flags_of() {  # the CMake flags of a flavor; every flavor has ggml's RPC backend (via-edge rpc-serve, --rpc)
  case "$1" in
    amx) echo "-DGGML_NATIVE=ON -DGGML_RPC=ON ${CMAKE_ARGS:-}" ;;
    noamx) echo "$noamx_flags -DGGML_RPC=ON ${CMAKE_ARGS:-}" ;;
    native) echo "-DGGML_RPC=ON ${CMAKE_ARGS:-}" ;;
  esac
}

wheel_dir() {  # the cache folder of a flavor: its flags, machine, Python and (amx) patch in the name
  local patch_hash=none
  if [ "$1" = amx ]; then patch_hash="$(sha256sum < "$amx_patch" | cut -c1-12)"; fi
  local key
  key="$(printf '%s|%s|%s|%s' "$(flags_of "$1")" "$(uname -sm)" \
    "$("$python" -c 'import sys; print(sys.version_info[:2])')" "$patch_hash" | sha256sum | cut -c1-12)"
  echo "$cache/llama-cpp-python-$llama_version-$1-$key"
}

fetch_source() {  # fetch_source FLAVOR DIR: the sdist unpacked under DIR (patched for amx); prints its path
  local fl="$1" dir="$2" pip_python="$python"
  [ -x "$venv/bin/python" ] && pip_python="$venv/bin/python"
  "$pip_python" -m pip download -q --no-deps --no-binary :all: -d "$dir" "llama-cpp-python==$llama_version" >&2
  tar -xzf "$dir/llama_cpp_python-$llama_version.tar.gz" -C "$dir"
  local source="$dir/llama_cpp_python-$llama_version"
  if [ "$fl" = amx ]; then
    [ -f "$amx_patch" ] || { echo "the AMX patch $amx_patch is missing" >&2; return 1; }
    if ! patch -p1 --forward --silent -d "$source" < "$amx_patch"; then
      echo "the AMX patch $amx_patch does not apply to llama-cpp-python $llama_version" >&2
      return 1
    fi
  fi
  echo "$source"
}
