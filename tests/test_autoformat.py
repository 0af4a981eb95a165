"""The automatic weight format on first use (weights/autoformat.py): chosen once, stored, reused,
overridable, and never leaving a half-written file or a second derivation behind."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from via_edge import Engine
from via_edge.errors import InvalidParameterError
from via_edge.weights import autoformat, formats
from via_edge.weights.autoformat import Candidate
from via_edge.weights.catalog import sha256_cached

CLI = [sys.executable, "-m", "via_edge"]


@pytest.fixture()
def auto_env(monkeypatch, tmp_path):
    """A model directory of this test's own and no format forced by the suite's default."""
    monkeypatch.setenv("VIA_EDGE_MODEL_DIR", str(tmp_path / "models"))
    monkeypatch.delenv("VIA_EDGE_FORMAT", raising=False)
    return tmp_path


@pytest.fixture()
def q4_model(tmp_path):
    """A tiny model shipped in Q4_0 (F32 embeddings and head): its q8_0 variant computes nearly what
    it computes, so it clears the gate (`FAST`: the candidates and speed-up the tests use)."""
    from make_tiny_gguf import make_tiny_gguf

    return make_tiny_gguf(tmp_path / "q4.gguf", arch="qwen2", blocks=2, n_embd=128, n_ff=256, seed=7, dtype="Q4_0")


FAST = dict(names=("q8_0",), min_speedup=0.0)


def test_requested_defaults_and_overrides(monkeypatch):
    monkeypatch.delenv("VIA_EDGE_FORMAT", raising=False)
    assert autoformat.requested(None, explicit_path=False) == "auto"
    assert autoformat.requested(None, explicit_path=True) == "shipped"
    assert autoformat.requested("q8_0", explicit_path=True) == "q8_0"
    monkeypatch.setenv("VIA_EDGE_FORMAT", "shipped")
    assert autoformat.requested(None, explicit_path=False) == "shipped"
    assert autoformat.requested("auto", explicit_path=True) == "auto"  # the flag beats the environment
    with pytest.raises(InvalidParameterError, match="--format must be auto, shipped or one of"):
        autoformat.requested("q3_fast", explicit_path=False)
    monkeypatch.setenv("VIA_EDGE_FORMAT", "bogus")
    with pytest.raises(InvalidParameterError, match="VIA_EDGE_FORMAT"):
        autoformat.requested(None, explicit_path=False)


def _cands(*rows):
    return [Candidate(f, ms, 1, agreement=a, ppl_ratio=p) for f, ms, a, p in rows]


def test_pick_takes_the_fastest_candidate_that_clears_gate_and_speedup():
    found = _cands(("shipped", 100.0, 1, 1), ("q4_0", 50.0, 0.95, 1.05), ("iq4_nl", 45.0, 0.85, 1.02),
                   ("q8_0", 80.0, 0.99, 1.00), ("q4_k", 60.0, 0.97, 1.20))
    best = autoformat._pick(found, 100.0, 1.15)
    assert best.format == "q4_0"  # iq4_nl is faster but below the agreement floor, q4_k above the ppl ceiling
    verdicts = {c.format: c.verdict for c in found}
    assert verdicts["iq4_nl"].startswith("agreement 0.850")
    assert verdicts["q4_k"].startswith("perplexity x1.200")
    assert verdicts["q8_0"] == ""  # cleared everything, just slower than q4_0
    # a clean candidate that is too little faster keeps the shipped file
    found = _cands(("shipped", 100.0, 1, 1), ("q8_0", 90.0, 0.99, 1.0))
    assert autoformat._pick(found, 100.0, 1.15).format == "shipped"
    assert "1.111x at one token < 1.15x" in found[1].verdict


def test_first_use_measures_stores_and_reuses(auto_env, q4_model, monkeypatch):
    path, name = autoformat.resolve(q4_model, "auto", _load(), quiet=True, **FAST)
    assert name == "q8_0" and path != q4_model and formats.variant_source(path)[0] == "q8_0"
    stored = autoformat.stored(sha256_cached(q4_model))
    assert stored.format == "q8_0" and stored.candidates[1].agreement >= autoformat.GATE_AGREEMENT
    assert stored.candidates[0].format == "shipped" and stored.candidates[1].verdict == "chosen"

    def no_measuring(*a, **k):
        raise AssertionError("a stored choice must be reused, not measured again")

    monkeypatch.setattr(autoformat, "choose", no_measuring)
    with Engine(q4_model, format="auto", n_ctx=256) as engine:
        assert engine.format == "q8_0" and engine.target_path == path
    with Engine(q4_model, n_ctx=256) as engine:  # a path runs as given unless auto is asked for
        assert engine.format == "shipped" and engine.target_path == q4_model
    path.unlink()  # deleted by `models rm`: derived again from the stored choice, not re-measured
    assert autoformat.resolve(q4_model, "auto", _load(), quiet=True)[0] == path and path.exists()


def test_cli_reports_the_format_and_honours_shipped(auto_env, q4_model):
    autoformat.resolve(q4_model, "auto", _load(), quiet=True, **FAST)
    env = {**os.environ}
    out = subprocess.run(CLI + ["generate", "hi", "--target", str(q4_model), "--format", "auto", "-n", "2", "--json"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["format"] == "q8_0" and data["models"]["target"].endswith(".gguf")
    assert data["models"]["target"] != str(q4_model)
    env["VIA_EDGE_FORMAT"] = "auto"
    out = subprocess.run(CLI + ["generate", "hi", "--target", str(q4_model), "--format", "shipped", "-n", "2"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "[lookup, shipped]" in out.stderr  # the status line names it; the flag beat the environment
    out = subprocess.run(CLI + ["generate", "hi", "--format", "q3_fast"], capture_output=True, text=True, env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "--format must be" in out.stderr
    info = subprocess.run(CLI + ["info"], capture_output=True, text=True, env=env)
    assert f"{q4_model.name}: q8_0" in info.stdout


def test_a_failing_gate_keeps_the_shipped_file(auto_env, smollm2):
    """SmolLM2-135M loses too much to 4-bit weights (docs/benchmarks.md, section 14): the real
    model's step measures, stores "shipped" with the reason, and the engine runs the shipped file."""
    path, name = autoformat.resolve(smollm2, "auto", _load(), quiet=True)
    assert (path, name) == (smollm2, "shipped")
    choice = autoformat.stored(sha256_cached(smollm2))
    assert choice.format == "shipped" and choice.candidates[1].verdict not in ("", "chosen")
    assert "keeping the shipped file" in choice.reason


def test_interrupted_derivation_leaves_nothing(auto_env, q4_model, monkeypatch):
    """Ctrl-C while the variant is being written: the partial file goes, nothing is stored, and
    the next use runs the step afresh."""
    real = formats.quantize

    def interrupted(source, dest, *a, **k):
        Path(dest).write_bytes(b"GGUF half")
        signal.raise_signal(signal.SIGINT)  # delivered to the main thread, as Ctrl-C is

    monkeypatch.setattr(formats, "quantize", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Engine(q4_model, format="auto", n_ctx=256)
    folder = formats.variant_path(q4_model, "q4_0", sha256_cached(q4_model)).parent
    assert not list(folder.glob("*.partial-*")) and not list(folder.glob("*.q4_0-*.gguf"))
    assert autoformat.stored(sha256_cached(q4_model)) is None
    monkeypatch.setattr(formats, "quantize", real)
    assert autoformat.resolve(q4_model, "auto", _load(), quiet=True, **FAST)[1] == "q8_0"


def test_a_second_process_waits_and_reuses_the_choice(auto_env, q4_model):
    """While another process holds the step's lock, a new one waits, then takes the stored choice
    without deriving or measuring anything itself."""
    sha = sha256_cached(q4_model)
    lock = autoformat.choice_path(sha).with_suffix(".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    proc = subprocess.Popen(CLI + ["generate", "hi", "--target", str(q4_model), "--format", "auto", "-n", "2",
                                   "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    waiting = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if "waiting for it" in line:
                waiting.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert waiting.wait(120), "".join(lines)
        # the choice is made meanwhile, as the first process would
        autoformat.choose(q4_model, sha, _load(), quiet=True, say=lambda m: None, **FAST)
    finally:
        os.close(fd)  # releases the lock
    out = proc.stdout.read()
    proc.wait(timeout=300)
    reader.join(10)
    errtext = "".join(lines)
    assert proc.returncode == 0, errtext
    assert "waiting for it" in errtext and "First use" not in errtext
    assert json.loads(out)["format"] == "q8_0"


def test_two_first_uses_at_once_derive_once(auto_env, q4_model):
    cmd = CLI + ["generate", "hi", "--target", str(q4_model), "--format", "auto", "-n", "2", "--json"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    assert sum("First use" in e for _, e in outs) == 1
    assert len({json.loads(o)["format"] for o, _ in outs}) == 1
    folder = formats.variant_path(q4_model, "q8_0", sha256_cached(q4_model)).parent
    assert not list(folder.glob("*.partial-*"))


def _load():
    from via_edge.llama import LoadParams

    return LoadParams(n_ctx=1024)


def test_a_derived_format_is_taken_only_if_a_second_timing_agrees(auto_env, q4_model, monkeypatch):
    """A first timing can be lucky: the format clearing the speed-up is timed again with both files
    loaded afresh and kept only if that timing clears it too; the next candidate is tried then."""
    from via_edge.tune import survey as survey_mod
    from via_edge.tune.survey import FormatRow
    from via_edge.weights.quality import Quality

    good = Quality(agreement=0.97, kl=0.01, ppl=10.2, ppl_source=10.0, positions=64)
    timings: list[dict[str, float]] = [{"shipped": 100.0, "q8_0": 50.0, "q4_0": 60.0},  # ms: q8_0 fastest, then q4_0
                                       {"shipped": 100.0, "q8_0": 95.0},                 # q8_0 again: 1.05x
                                       {"shipped": 100.0, "q4_0": 62.0}]                 # q4_0 again: 1.61x
    calls = []

    def fake_survey(sources, names, *a, **k):
        ms = timings[len(calls)]
        calls.append(list(names))
        rows = [FormatRow("target", n, q4_model, 1, cost={1: ms[n] / 1e3}, quality=None if n == "shipped" else good)
                for n in ["shipped", *names]]
        return {"target": rows}

    monkeypatch.setattr(survey_mod, "survey", fake_survey)
    choice = autoformat.choose(q4_model, sha256_cached(q4_model), _load(), names=("q8_0", "q4_0"), quiet=True,
                               say=lambda m: None)
    assert calls == [["q8_0", "q4_0"], ["q8_0"], ["q4_0"]]
    assert choice.format == "q4_0" and "1.61x timed again" in choice.reason
    by = {c.format: c for c in choice.candidates}
    assert by["q8_0"].verdict == "2.000x at one token, then 1.053x timed again < 1.15x"
    assert by["q4_0"].verdict == "chosen" and by["q4_0"].again == pytest.approx(100 / 62)
    # nothing passes its second timing: the shipped file stays and says why
    timings[2] = {"shipped": 100.0, "q4_0": 90.0}
    calls.clear()
    choice = autoformat.choose(q4_model, sha256_cached(q4_model), _load(), names=("q8_0", "q4_0"), quiet=True,
                               say=lambda m: None)
    assert choice.format == "shipped" and "then 1.111x timed again" in choice.reason
