"""tools/ is a toolbox the docs cite by command: every script must still run against today's
package (a renamed method once left `tools/tune_error.py` failing only when run, while a test that
merely imported it passed) and be cited somewhere a reader finds it."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
TOOLS = sorted((ROOT / "tools").glob("*.py"))
DOCS = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


@pytest.mark.slow
@pytest.mark.parametrize("path", TOOLS, ids=[p.name for p in TOOLS])
def test_every_tool_says_how_to_run_it(path):
    """`--help` runs the script's top level and its argument parser, and nothing more."""
    out = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage" in out.stdout.lower(), out.stdout[:500]


@pytest.mark.parametrize("path", TOOLS, ids=[p.name for p in TOOLS])
def test_every_tool_is_cited_by_the_docs(path):
    assert f"tools/{path.name}" in DOCS, f"no page under docs/ or README.md cites tools/{path.name}"


def test_a_subcommand_tool_lists_its_questions():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "batch_costs.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "layouts" in out.stdout and "chunks" in out.stdout
