"""tools/ is a toolbox docs/benchmarks.md cites by command: every script must still load against
today's package (a renamed function once left `tools/step_trace.py` failing at import)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = sorted((Path(__file__).parent.parent / "tools").glob("*.py"))


@pytest.mark.parametrize("path", TOOLS, ids=[p.name for p in TOOLS])
def test_a_tool_loads_and_runs_only_when_called(path):
    """Importing runs the module's top level (imports, patched names) and nothing more."""
    spec = importlib.util.spec_from_file_location(f"tool_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"


def test_a_tool_says_how_to_run_it():
    out = subprocess.run([sys.executable, str(TOOLS[0].parent / "batch_costs.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "layouts" in out.stdout and "chunks" in out.stdout
