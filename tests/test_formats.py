"""Weight-format variants (llama_model_quantize) and their quality against the source: real
llama.cpp, a tiny K-quant-shaped model and SmolLM2."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import interruptible, make_tiny_gguf

from via_edge import Engine
from via_edge.errors import ModelFileError, ViaEdgeError
from via_edge.llama import LlamaModel, LoadParams
from via_edge.tune.survey import QUALITY_FLOOR
from via_edge.weights import formats
from via_edge.weights.quality import compare, greedy_continuations


@pytest.fixture(scope="module")
def tiny256(tmp_path_factory) -> Path:
    """Rows of 256 (a K-quant block) so that every recipe applies without fallback types."""
    d = tmp_path_factory.mktemp("fmt")
    return make_tiny_gguf(d / "t256.gguf", arch="qwen2", blocks=2, n_embd=256, n_ff=512, seed=11)


@pytest.mark.parametrize("name", list(formats.RECIPES))
def test_variant_has_the_tensor_types_its_recipe_promises(tiny256, name):
    r = formats.recipe(name)
    path = formats.derive(tiny256, name, quiet=True)
    types = formats.tensor_types(path)
    weights = {n: t for n, t in types.items() if n.endswith(".weight") and "norm" not in n}
    assert weights, types
    head = formats.tensor_types(tiny256)["output.weight"] if r.head == formats.SOURCE_HEAD else r.head
    assert head != r.body  # the head's own type is really kept apart from the body's
    for n, t in weights.items():
        want = head if (r.head and n == "output.weight") else r.body
        assert t == want, (n, t, want)
    assert all(t == "F32" for n, t in types.items() if "norm" in n)
    assert formats.variant_source(path) == (name, formats.sha256_cached(tiny256))
    assert path.name == f"{tiny256.stem}.{name}-{formats.sha256_cached(tiny256)[:12]}.gguf"
    assert abs(path.stat().st_size - formats.estimate_size(tiny256, r)) < 5 << 20
    with LlamaModel(path, LoadParams(n_ctx=64)) as m:  # llama.cpp loads and runs it
        assert m.seqs[0].eval([1, 2, 3]).shape == (1, m.n_vocab)
    mtime = path.stat().st_mtime_ns
    assert formats.derive(tiny256, name, quiet=True) == path and path.stat().st_mtime_ns == mtime  # reused


def test_tied_model_gets_its_head_type_on_the_embedding(tmp_path):
    src = make_tiny_gguf(tmp_path / "tied.gguf", arch="llama", blocks=1, n_embd=256, n_ff=512, tied=True, seed=2)
    types = formats.tensor_types(formats.derive(src, "q4_0-q8head", quiet=True))
    assert "output.weight" not in types and types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.ffn_down.weight"] == "Q4_0"


def test_source_head_recipes_keep_a_quantized_head_as_it_was(tmp_path):
    """Q8_0 body with the source's LM head, on a source whose head is quantized (Q4_0 here, as a
    shipped Q4_K_M keeps its Q6_K head)."""
    src = formats.derive(make_tiny_gguf(tmp_path / "s.gguf", blocks=1, n_embd=256, n_ff=512, seed=4), "q4_0",
                         quiet=True)
    types = formats.tensor_types(formats.derive(src, "q8_0-srchead", quiet=True))
    assert types["output.weight"] == "Q4_0" and types["blk.0.ffn_down.weight"] == "Q8_0"


def test_default_formats_follow_the_build():
    from via_edge.llama import system_info

    amx = "AMX_INT8 = 1" in system_info()
    assert formats.default_formats() == (formats.AMX_FORMATS if amx else formats.OTHER_FORMATS)
    assert {"q4_0", "q8_0", "q4_0-srchead", "q8_0-srchead", "iq4_nl", "shipped"} == set(formats.AMX_FORMATS)
    formats.check_names(list(formats.AMX_FORMATS + formats.OTHER_FORMATS))


def test_quality_figures_are_cached_per_source_format_and_prompts(tiny256, tmp_path, monkeypatch):
    """A second survey of the same variant reads the stored figures (even with the variant gone);
    other prompts measure again."""
    from via_edge.tune.survey import qualities

    monkeypatch.setenv("VIA_EDGE_MODEL_DIR", str(tmp_path))
    copy = tmp_path / "v.gguf"
    shutil.copy(formats.derive(tiny256, "q8_0", quiet=True), copy)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    load = LoadParams(n_ctx=128)
    first = qualities(tiny256, {"q8_0": copy}, prompts, 6, load)["q8_0"]
    assert first.positions == 12 and 0.0 <= first.agreement <= 1.0
    assert len(list((tmp_path / "quality").glob("*--q8_0--*.json"))) == 1
    copy.unlink()
    assert qualities(tiny256, {"q8_0": copy}, prompts, 6, load)["q8_0"] == first
    with pytest.raises(ModelFileError):  # other prompts are not served from the cache: it loads again
        qualities(tiny256, {"q8_0": copy}, prompts[:1], 6, load)


def test_cache_is_keyed_by_the_source_sha256(tmp_path):
    """A source changed in place gets its own variant; the old one is never served for it."""
    src = make_tiny_gguf(tmp_path / "m.gguf", arch="qwen2", blocks=1, n_embd=256, n_ff=512, seed=1)
    first = formats.derive(src, "q4_0", quiet=True)
    make_tiny_gguf(src, arch="qwen2", blocks=1, n_embd=256, n_ff=512, seed=2)
    second = formats.derive(src, "q4_0", quiet=True)
    assert second != first and formats.variant_source(second)[1] == formats.sha256_cached(src)
    # a foreign file under the variant's name (say, copied from another source) is replaced, not used
    shutil.copy(first, second)
    assert formats.variant_source(formats.derive(src, "q4_0", quiet=True))[1] == formats.sha256_cached(src)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_interrupted_derivation_leaves_no_file_under_the_final_name(smollm2, tmp_path, sig):
    src = tmp_path / smollm2.name
    shutil.copy(smollm2, src)
    final = formats.variant_path(src, "iq4_nl", formats.sha256_cached(src))
    code = f"from via_edge.weights import formats; formats.derive({str(src)!r}, 'iq4_nl', quiet=True, threads=1)"
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, preexec_fn=interruptible)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(final.name + ".partial-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.glob(final.name + ".partial-*")), "the derivation never started writing"
    proc.send_signal(sig)
    proc.wait(30)
    assert proc.returncode != 0
    assert not final.exists()
    if sig == signal.SIGINT:  # handled: the partial file is removed at once
        assert not list(tmp_path.glob(final.name + ".partial-*"))
    # the next derivation cleans up after a killed one and completes
    assert formats.derive(src, "q4_0", quiet=True).exists()
    assert not list(tmp_path.glob("*.partial-*"))


def test_not_enough_disk_is_refused_before_writing(tmp_path, monkeypatch):
    src = make_tiny_gguf(tmp_path / "m.gguf", arch="qwen2", blocks=1, n_embd=256, n_ff=512, seed=4)
    monkeypatch.setattr(formats.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 << 30, 10 << 30, 1 << 20))
    with pytest.raises(ViaEdgeError, match="not enough free disk"):
        formats.derive(src, "iq4_nl", quiet=True)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["m.gguf"]


def test_missing_damaged_and_unknown_sources(tmp_path, tiny256):
    with pytest.raises(ModelFileError, match="not found"):
        formats.derive(tmp_path / "nope.gguf", "q4_0")
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(tiny256.read_bytes()[: tiny256.stat().st_size // 2])
    with pytest.raises(ModelFileError):
        formats.derive(bad, "q4_0")
    assert not list(tmp_path.glob("cut.q4_0*"))
    with pytest.raises(ViaEdgeError, match="unknown format 'q3'"):
        formats.derive(tiny256, "q3")


@pytest.fixture(scope="module")
def smol_prompts(smollm2):
    from via_edge.prompts import chat_tokens
    from via_edge.tune.record import calibration_prompts

    with LlamaModel(smollm2, LoadParams(n_ctx=1024)) as m:
        return [chat_tokens(m, [{"role": "user", "content": p.text}]) for p in calibration_prompts(1)[:4]]


@pytest.mark.slow
def test_quality_accepts_an_identical_copy_and_rejects_a_damaged_variant(smollm2, smol_prompts, tmp_path):
    """The identical file (loaded separately) agrees on every position with KL 0 and equal
    perplexity; a Q2_K requantization of the same model falls below the floor, with a KL and
    perplexity ratio that say so."""
    copy = tmp_path / "copy.gguf"
    shutil.copy(smollm2, copy)
    damaged = tmp_path / "q2k.gguf"
    formats._quantize(smollm2, damaged, formats.Recipe("q2_k", "Q2_K", "Q2_K"), "0" * 64, None,
                      formats.ByteProgress("q2_k", 1, quiet=True))
    load = LoadParams(n_ctx=1024)
    with LlamaModel(smollm2, load) as src, LlamaModel(copy, load) as same, LlamaModel(damaged, load) as bad:
        conts = greedy_continuations(src, smol_prompts, 24)
        q = compare(src, {"same": same, "q2_k": bad}, smol_prompts, conts, text=src.tokenize("def f(x):\n" * 40)
                    + src.tokenize("The quick brown fox jumps over the lazy dog. " * 20))
    assert q["same"].positions == sum(map(len, conts)) > 50
    assert q["same"].agreement == 1.0 and q["same"].kl == pytest.approx(0.0, abs=1e-4)
    assert q["same"].ppl_ratio == pytest.approx(1.0, abs=1e-3)
    assert q["q2_k"].agreement < QUALITY_FLOOR and q["q2_k"].kl > 0.3 and q["q2_k"].ppl_ratio > 1.2


@pytest.mark.slow
def test_tuned_format_is_what_the_engine_loads(tmp_path, monkeypatch):
    """A tuned choice naming a format makes from_pair load that variant (derived on demand);
    untuned loads the shipped file."""
    from via_edge.tune.store import TunedConfig, tuned_path
    from via_edge.weights.catalog import entry

    monkeypatch.setenv("VIA_EDGE_MODEL_DIR", str(tmp_path))
    monkeypatch.setenv("VIA_EDGE_FORMAT", "auto")  # a tuned choice wins over auto, not over a format asked for
    shipped = entry("smollm2-135m-instruct").installed_path()
    path = tuned_path("smollm2", "choice")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(TunedConfig("smollm2", "ar", None, {"ar": {}}, "test", target_format="q4_0").to_dict()))
    with Engine.from_pair("smollm2", n_ctx=256) as e:
        assert formats.variant_source(e.target_path)[0] == "q4_0" and e.weight_format == "q4_0"
        assert e.model_name == "smollm2-135m-instruct"
    with Engine.from_pair("smollm2", format="shipped", n_ctx=256) as e:
        assert e.target_path == shipped and e.format == "shipped"
    with Engine.from_pair("smollm2", tuned=False, format="shipped", n_ctx=256) as e:
        assert e.target_path == shipped


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "via_edge", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args,match", [
    (["models", "optimize", "smollm2", "--formats", "q4_0,q3"], "unknown format 'q3'"),
    (["models", "optimize", "smollm2", "--quality-floor", "1.2"], "--quality-floor must be in [0, 1]"),
    (["models", "optimize", "/nonexistent/model.gguf"], "model file not found"),
    (["tune", "--quality-floor", "-0.1"], "--quality-floor must be in [0, 1]"),
    (["tune", "--formats", "shipped,fp3"], "unknown format 'fp3'"),
])
def test_bad_format_input_is_one_message_and_exit_2(args, match):
    proc = cli(*args)
    assert proc.returncode == 2 and match in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_optimize_prints_costs_quality_and_the_pick(tmp_path):
    proc = cli("models", "optimize", "smollm2-135m-instruct", "--formats", "q4_0,q4_0-q8head", "--prompts", "2",
               "--tokens", "8", "--repeats", "1", "--out", tmp_path, env={"VIA_EDGE_MODEL_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "| model | shipped |" in out and "| model | q4_0 |" in out and "n=8 ms" in out
    assert "plain decoding would run" in out
    data = json.loads((tmp_path / "optimize.json").read_text())
    rows = data["rows"]["model"]
    assert [r["format"] for r in rows] == ["shipped", "q4_0", "q4_0-q8head"]
    assert rows[0]["quality"] is None and 0.0 <= rows[1]["quality"]["agreement"] <= 1.0
    assert all(set(r["cost_ms"]) == {"1", "2", "4", "8", "16"} for r in rows)


@pytest.mark.slow
def test_bench_tuned_runs_the_tuned_format_beside_the_shipped_peers(tmp_path, monkeypatch):
    """bench --tuned loads the tuned format for <mode>:tuned (ar:tuned exists because the format
    differs), while ar and llama-cpp-python run the shipped file; the report names each format."""
    from via_edge.tune.store import TunedConfig, tuned_path

    env = {"VIA_EDGE_MODEL_DIR": str(tmp_path)}
    monkeypatch.setenv("VIA_EDGE_MODEL_DIR", str(tmp_path))
    path = tuned_path("smollm2", "choice")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(TunedConfig("smollm2", "ar", None, {"ar": {}}, "t", target_format="q4_0").to_dict()))
    proc = cli("bench", "--pair", "smollm2", "--tuned", "--modes", "ar", "--categories", "coding,math_reasoning",
               "-n", "8", "--out", tmp_path / "b", env=env)
    assert proc.returncode == 0, proc.stderr
    res = json.loads((tmp_path / "b" / "results.json").read_text())
    assert res["meta"]["methods"] == ["ar", "ar:tuned", "llama-cpp-python", "llama-cpp-python-lookup"]
    assert res["meta"]["formats"] == {"ar": "Q4_1", "ar:tuned": "q4_0", "llama-cpp-python": "Q4_1",
                                      "llama-cpp-python-lookup": "Q4_1"}
    assert not res["summary"]["ar:tuned"]["lossless"] and res["summary"]["llama-cpp-python"]["lossless"]
    assert "| ar:tuned (lossy) | q4_0 |" in (tmp_path / "b" / "report.md").read_text()
