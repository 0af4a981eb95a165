"""Flash attention on or off as measured faster here (decode/attention.py), on real llama.cpp with
tiny GGUFs. The tiny files are far under the size from which the choice is measured, so each test
that wants the measurement lowers that bound; the choice is stored per file, so each test makes
a file of its own."""

import itertools
import json
import subprocess
import sys

import pytest
from conftest import make_tiny_gguf

from via_edge import Engine
from via_edge.decode import attention, costs
from via_edge.llama import LlamaModel, LoadParams
from via_edge.llama.runtime import default_threads

PARAMS = LoadParams(n_ctx=512, kv_type="f32", use_extra_bufts=False)


SEEDS = itertools.count(100)


@pytest.fixture
def fresh(tmp_path):
    """A tiny model no other test has measured (its own weights, so its own SHA-256)."""
    return make_tiny_gguf(tmp_path / "t.gguf", arch="qwen2", blocks=2, seed=next(SEEDS))


def recorder(path):
    opened: list[LlamaModel] = []

    def open_model(params: LoadParams) -> LlamaModel:
        opened.append(LlamaModel(path, params))
        return opened[-1]
    return opened, open_model


def stored(path) -> dict | None:
    p = attention._path(path, PARAMS)
    return json.loads(p.read_text()) if p.exists() else None


def test_the_first_load_measures_both_and_keeps_the_faster(fresh, monkeypatch):
    monkeypatch.setattr(attention, "MIN_BYTES", 0)
    opened, open_model = recorder(fresh)
    kept = attention.open_fastest(fresh, PARAMS, open_model)
    got = stored(fresh)
    assert [m.params.flash_attn for m in opened] == [True, False]
    assert got["on"] > 0 and got["off"] > 0 and got["context"] == 256  # half of the 512-token window
    assert got["flash_attn"] == (got["on"] / got["off"] < attention.GAIN)
    assert kept.params.flash_attn == got["flash_attn"]
    dropped = opened[1] if got["flash_attn"] else opened[0]
    assert dropped._ctx is None and kept._ctx is not None  # the slower one is closed
    assert kept.seqs[0].tokens == [] and kept.usage.tokens == 0  # the measurement left nothing behind
    kept.close()
    again, open_again = recorder(fresh)  # read back: one load, the stored setting
    attention.open_fastest(fresh, PARAMS, open_again).close()
    assert [m.params.flash_attn for m in again] == [got["flash_attn"]]


@pytest.mark.parametrize("on_seconds, off", [(1.0, False), (1.04, False), (1.05, True), (1.5, True)])
def test_flash_attention_goes_off_from_five_percent_faster(fresh, monkeypatch, on_seconds, off):
    monkeypatch.setattr(attention, "MIN_BYTES", 0)
    monkeypatch.setattr(attention, "measure", lambda on, o: {"context": 256, "on": on_seconds, "off": 1.0})
    opened, open_model = recorder(fresh)
    with attention.open_fastest(fresh, PARAMS, open_model) as kept:
        assert kept.params.flash_attn is (not off)
    assert stored(fresh)["flash_attn"] is (not off)


@pytest.mark.parametrize("given", [True, False])
def test_a_setting_given_is_used_as_given_and_nothing_is_measured(fresh, monkeypatch, given):
    monkeypatch.setattr(attention, "MIN_BYTES", 0)
    opened, open_model = recorder(fresh)
    attention.open_fastest(fresh, LoadParams(n_ctx=512, kv_type="f32", flash_attn=given), open_model).close()
    assert [m.params.flash_attn for m in opened] == [given] and stored(fresh) is None


def test_a_small_file_keeps_llama_cpps_default_unmeasured(fresh):
    opened, open_model = recorder(fresh)
    attention.open_fastest(fresh, PARAMS, open_model).close()
    assert [m.params.flash_attn for m in opened] == [None] and stored(fresh) is None


def test_an_interrupted_measurement_stores_nothing_and_closes_what_it_opened(fresh, monkeypatch):
    monkeypatch.setattr(attention, "MIN_BYTES", 0)
    opened, open_model = recorder(fresh)

    def interrupted(on, off):
        raise KeyboardInterrupt
    monkeypatch.setattr(attention, "measure", interrupted)
    with pytest.raises(KeyboardInterrupt):
        attention.open_fastest(fresh, PARAMS, open_model)
    assert stored(fresh) is None and [m._ctx for m in opened] == [None, None]


@pytest.mark.parametrize("off", [False, True])
def test_the_engine_loads_every_model_with_the_targets_choice(fresh, monkeypatch, off):
    """The slim takes the target's KV cache and the prefill helper hands its own over: their
    layouts follow the setting, so all load with the target's. The first load says so on the
    status line; the batch costs `lookup` reads are kept apart per setting."""
    monkeypatch.setattr(attention, "MIN_BYTES", 0)
    monkeypatch.setattr(attention, "measure", lambda on, o: {"context": 256, "on": 2.0 if off else 1.0, "off": 1.0})
    said: list[str] = []
    with Engine(fresh, mode="hier", draft_layers="0-0", slim_layers="0-0", n_ctx=512, kv_type="f32",
                prefill_helper=True, progress=lambda what, frac: said.append(what)) as engine:
        engine.prepare("lookup")
        m = engine.models
        assert {x.params.flash_attn for x in (m.target, m.draft, m.slim, m.target.prefiller.helper)} == {not off}
        assert costs._path(m.target).name.endswith("--nofa.json") is off
        assert engine.generate([3, 5, 7, 9], max_tokens=6).tokens  # decodes through all three
    assert "attention" in said


@pytest.mark.parametrize("exact, flag, want", [(False, None, None), (True, None, True), (True, False, False),
                                              (False, False, False)])
def test_exact_keeps_flash_attention_on_unless_told(exact, flag, want):
    from via_edge.cli.options import RUN_OPTS, Options

    values = {o.name: o.default for o in RUN_OPTS} | {"exact": exact, "flash_attn": flag}
    assert Options(values).load().flash_attn is want


def test_info_lists_the_measured_choice(fresh):
    path = attention._path(fresh, LoadParams())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": "some.gguf", "flash_attn": False, "context": 512, "on": 1.1, "off": 1.0,
                                "off_gain": 1.1}))
    out = subprocess.run([sys.executable, "-m", "via_edge", "info"], capture_output=True, text=True, timeout=120)
    assert f"some.gguf ({default_threads()} threads): 1.10x as fast without it, so off" in out.stdout
