"""tools/ is a toolbox the docs cite by command: every script must still run against today's
package (a renamed method once left `tools/tune_error.py` failing only when run, while a test that
merely imported it passed) and be cited somewhere a reader finds it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
TOOLS = sorted((ROOT / "tools").glob("*.py"))
SCRIPTS = sorted((ROOT / "tools").glob("*.sh"))
DOCS = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


@pytest.mark.slow
@pytest.mark.parametrize("path", TOOLS, ids=[p.name for p in TOOLS])
def test_every_tool_says_how_to_run_it(path):
    """`--help` runs the script's top level and its argument parser, and nothing more."""
    out = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage" in out.stdout.lower(), out.stdout[:500]


@pytest.mark.parametrize("path", TOOLS + SCRIPTS, ids=[p.name for p in TOOLS + SCRIPTS])
def test_every_tool_is_cited_by_the_docs(path):
    assert f"tools/{path.name}" in DOCS, f"no page under docs/ or README.md cites tools/{path.name}"


def test_a_subcommand_tool_lists_its_questions():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "batch_costs.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "layouts" in out.stdout and "chunks" in out.stdout


def test_the_llama_server_build_goes_beside_its_flavors_wheel_and_refuses_unknown_options():
    """llama-server is built with a flavor's flags and patch: its folder is that flavor's wheel folder
    (whose name carries them) plus `-server`."""
    env = {**os.environ, "VIA_EDGE_LLAMA_FLAVOR": "noamx"}
    script = ROOT / "tools" / "build_llama_server.sh"
    helped = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "llama-server" in helped.stdout
    printed = subprocess.run(["bash", str(script), "--print"], capture_output=True, text=True, timeout=60, env=env)
    wheels = subprocess.run(["bash", str(ROOT / "tools" / "install.sh")], capture_output=True, text=True, timeout=60,
                            env={**env, "VIA_EDGE_PRINT_WHEEL_DIR": "noamx"})
    assert printed.returncode == 0 and wheels.returncode == 0
    assert printed.stdout.strip() == wheels.stdout.strip() + "-server/llama-server"
    bad = subprocess.run(["bash", str(script), "--fast"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown option" in bad.stderr
