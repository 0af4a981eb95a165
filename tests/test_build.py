"""The llama.cpp build: the AMX self-check where the CPU has AMX, the installer's flavor choice
and patch, and what `via-edge info` reports."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from via_edge.llama import system_info
from via_edge.machine import build, has_amx

sys.path.insert(0, str(ROOT / "tools"))
import check_build  # noqa: E402

PATCH = ROOT / "tools" / "patches" / "llama-cpp-python-0.3.36-amx-tile-config.patch"


def test_amx_kernels_agree_with_plain_kernels():
    """Every quantized type with AMX kernels decodes a batch through them without crashing and
    within check_build's tolerance of the plain kernels (each decode in a child process)."""
    if not has_amx():
        pytest.skip("this CPU has no AMX (no amx_int8 in /proc/cpuinfo): the amx flavor is not built here")
    if "AMX_INT8 = 1" not in system_info():
        pytest.skip("the installed llama.cpp build has no AMX kernels (the noamx fallback or an override)")
    results = check_build.run_checks()
    assert [ok for ok, _ in results] == [True] * len(check_build.TYPES), [line for _, line in results]


def test_the_build_reports_its_flavor():
    b = build()
    assert b["flavor"] in ("amx", "noamx", "native")
    assert ("AMX_INT8" in b["features"]) == (b["flavor"] == "amx")
    if has_amx():  # the installer never leaves an unpatched AMX build on an AMX machine
        assert b["flavor"] in ("amx", "noamx")


def test_info_and_version_name_the_build(tmp_path):
    env = {**os.environ, "VIA_EDGE_MODEL_DIR": str(tmp_path)}
    exe = [sys.executable, "-m", "via_edge"]
    out = subprocess.run(exe + ["info"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    flavor = build()["flavor"]
    assert f"llama.cpp build: {flavor}" in out.stdout
    assert f"models: {tmp_path}" in out.stdout
    assert "REPACK" in out.stdout.split("features:")[1].splitlines()[0]
    ver = subprocess.run(exe + ["--version"], capture_output=True, text=True, env=env, timeout=120)
    assert ver.returncode == 0 and f"llama.cpp {flavor} build" in ver.stdout


@pytest.mark.slow
def test_amx_patch_applies_to_the_pinned_source(tmp_path):
    """The patch applies to the vendored mmq.cpp of llama-cpp-python 0.3.36 as pip fetches it
    (skipped without the sdist in pip's reach)."""
    dl = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                         "-d", str(tmp_path), "llama-cpp-python==0.3.36"], capture_output=True, text=True,
                        timeout=600)
    if dl.returncode != 0:
        pytest.skip(f"the llama-cpp-python sdist cannot be fetched here: {dl.stderr.strip()[-200:]}")
    member = "llama_cpp_python-0.3.36/vendor/llama.cpp/ggml/src/ggml-cpu/amx/mmq.cpp"
    subprocess.run(["tar", "-xzf", str(tmp_path / "llama_cpp_python-0.3.36.tar.gz"), "-C", str(tmp_path), member],
                   check=True)
    src = tmp_path / "llama_cpp_python-0.3.36"
    res = subprocess.run(["patch", "-p1", "--forward", "-d", str(src)], stdin=PATCH.open(), capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    patched = (src / member.split("/", 1)[1]).read_text()
    assert "static const tile_config_t config" in patched and 'asm volatile("" ::: "memory")' in patched


def test_installer_rejects_an_unknown_flavor(tmp_path):
    res = subprocess.run(["bash", str(ROOT / "tools" / "install.sh")], capture_output=True, text=True,
                         env={**os.environ, "VIA_EDGE_LLAMA_FLAVOR": "fast", "VENV": str(tmp_path / "v")},
                         timeout=60)
    assert res.returncode == 2
    assert "must be amx, noamx or native, not 'fast'" in res.stderr
    assert not (tmp_path / "v").exists()  # nothing made before the check


def test_a_patch_that_does_not_apply_falls_back_to_noamx(tmp_path):
    """The amx flavor with a patch that does not apply: one line, then the noamx build (taken from
    the wheel cache when it is there, as on any machine that installed before), and the install
    completes."""
    cache = Path(os.environ.get("VIA_EDGE_WHEEL_CACHE", Path.home() / ".cache" / "via-edge" / "wheels"))
    noamx = subprocess.run(["bash", str(ROOT / "tools" / "install.sh")], capture_output=True, text=True, check=True,
                           env={**os.environ, "VIA_EDGE_PRINT_WHEEL_DIR": "noamx",
                                "VIA_EDGE_WHEEL_CACHE": str(cache)}).stdout.strip()
    if not list(Path(noamx).glob("*.whl")):
        pytest.skip(f"no cached noamx wheel ({noamx}): this fallback would compile llama.cpp (minutes)")
    bad = tmp_path / "bad.patch"
    bad.write_text("--- a/nothing.cpp\n+++ b/nothing.cpp\n@@ -1,1 +1,1 @@\n-old\n+new\n")
    venv = tmp_path / "v"
    res = subprocess.run(["bash", str(ROOT / "tools" / "install.sh")], capture_output=True, text=True,
                         env={**os.environ, "VIA_EDGE_LLAMA_FLAVOR": "amx", "VIA_EDGE_AMX_PATCH": str(bad),
                              "VENV": str(venv), "VIA_EDGE_WHEEL_CACHE": str(cache)}, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "does not apply" in res.stderr and "falling back to the noamx build" in res.stderr
    assert '"flavor": "noamx"' in (venv / "via-edge-build.json").read_text()
