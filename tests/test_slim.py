"""Slim verifiers: derived GGUFs of a subset of the target's blocks, and KV import."""

import numpy as np
import pytest
from conftest import EXACT, make_tiny_gguf

from via_edge.decode.drafters import check_compatible
from via_edge.errors import IncompatibleModelsError, LayerSpecError
from via_edge.llama import LlamaModel, LoadParams
from via_edge.weights.gguf_info import field_value, open_reader
from via_edge.weights.slim import build_slim, check_supported, format_layers, parse_layers, slice_seq_state

PARAMS = LoadParams(**EXACT)


def test_parse_and_format_layers():
    assert parse_layers("0-20", 28) == tuple(range(21))
    assert parse_layers("0-3,14-27", 28) == (0, 1, 2, 3) + tuple(range(14, 28))
    assert parse_layers(" 5 ", 28) == (5,)
    assert format_layers((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"


@pytest.mark.parametrize("spec,msg", [("", "empty"), ("  ", "empty"), ("0-28", "out of range"),
                                      ("14-27,0-3", "increasing"), ("0-5,5-7", "twice"),
                                      ("3,1", "increasing"), ("5-2", "backwards"), ("a-b", "bad layer"),
                                      ("0-3,2", "twice")])
def test_bad_layer_specs(spec, msg):
    with pytest.raises(LayerSpecError, match=msg):
        parse_layers(spec, 28)


def test_refused_architectures():
    with pytest.raises(LayerSpecError, match="attention scale"):
        check_supported("gemma3", 62, tuple(range(40)), 0)
    with pytest.raises(LayerSpecError, match="multi-token"):
        check_supported("glm4moe", 47, tuple(range(47)), 1)
    with pytest.raises(LayerSpecError, match="alternates"):
        check_supported("gemma3", 18, (0, 1, 2, 4), 0)
    check_supported("gemma3", 18, tuple(range(12)), 0)  # a prefix keeps every block's kind
    check_supported("gemma3", 18, tuple(range(6)) + tuple(range(12, 18)), 0)  # whole periods
    check_supported("glm4moe", 47, tuple(range(46)), 1)  # MTP tail left out


def rms_norm(x, w, eps=1e-6):
    return x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * w


def test_prefix_slim_equals_target_hidden_state_through_head(tiny_llama, tmp_path):
    """Slim of blocks 0-1 == the target's layer-1 output (read with cb_eval) -> final norm -> LM head."""
    slim = build_slim(tiny_llama, "0-1", tmp_path / "slim.gguf")
    reader = open_reader(tiny_llama)
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    with LlamaModel(tiny_llama, LoadParams(**EXACT, capture=("l_out-1",))) as target, \
            LlamaModel(slim, PARAMS) as small:
        toks = target.tokenize("the slim verifier sees the same tokens", add_special=False)
        target.seqs[0].decode(toks, "none")
        hidden = target.captured("l_out-1")
        expected = rms_norm(hidden, tensors["output_norm.weight"]) @ tensors["token_embd.weight"].T
        got = small.seqs[0].decode(toks, "all")
        assert small.n_layer == 2
        assert np.abs(got - expected).max() < 1e-3 * np.abs(expected).max()
        assert (got.argmax(1) == expected.argmax(1)).all()


def no_reader(*_):
    raise AssertionError("gguf-py's reader opened: it parses the vocabulary for seconds (15 s for Qwen's)")


def test_middle_cut_slim_metadata_and_reuse(tiny_target, tmp_path, monkeypatch):
    out = tmp_path / "mid.gguf"
    path = build_slim(tiny_target, "0,3", out)
    reader = open_reader(path)
    assert field_value(reader, "qwen2.block_count") == 2
    assert field_value(reader, "via_edge.slim.layers") == "0,3"
    names = {t.name for t in reader.tensors}
    assert "blk.1.attn_q.weight" in names and "blk.2.attn_q.weight" not in names
    src = {t.name: t for t in open_reader(tiny_target).tensors}
    for t in reader.tensors:  # block 3 became block 1, bytes copied verbatim
        if t.name.startswith("blk.1."):
            assert np.array_equal(np.array(t.data), np.array(src[t.name.replace("blk.1.", "blk.3.")].data))
    mtime = path.stat().st_mtime_ns
    with monkeypatch.context() as m:  # reused from the header scans alone
        m.setattr("via_edge.weights.slim.open_reader", no_reader)
        assert build_slim(tiny_target, "0,3", out) == path and path.stat().st_mtime_ns == mtime
    assert not list(tmp_path.glob("*.partial"))
    with LlamaModel(path, PARAMS) as m:
        assert m.n_layer == 2 and np.isfinite(m.seqs[0].eval(m.tokenize("ok"), 1)).all()


def test_per_layer_metadata_arrays_are_sliced(tiny_target, tmp_path):
    import gguf

    reader = open_reader(tiny_target)
    src = tmp_path / "arrays.gguf"
    w = gguf.GGUFWriter(str(src), "qwen2")
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vt = f.types[0]
        w.add_key_value(f.name, f.contents(), vt, sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    w.add_array("qwen2.test_per_layer", [10, 11, 12, 13])
    for t in reader.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in reader.tensors:
        w.write_tensor_data(t.data)
    w.close()
    slim = build_slim(src, "1-2", tmp_path / "arrays-slim.gguf")
    assert field_value(open_reader(slim), "qwen2.test_per_layer") == [11, 12]


def test_default_slim_name_derives_from_hash_and_layers(tiny_target):
    path = build_slim(tiny_target, "0-2")
    assert path.parent == tiny_target.parent
    assert "-L0-2.gguf" in path.name and ".slim2-" in path.name


@pytest.mark.parametrize("flash", [False, True])
def test_kv_import_is_bit_identical_to_prefill(tiny_target, tmp_path, flash):
    slim_path = build_slim(tiny_target, "0-1", tmp_path / "prefix.gguf")
    params = LoadParams(n_ctx=256, flash_attn=flash)
    with LlamaModel(tiny_target, params) as target, LlamaModel(slim_path, params) as a, \
            LlamaModel(slim_path, params) as b:
        toks = target.tokenize("import the prompt's KV instead of computing it twice", add_special=False)
        target.seqs[0].prefill(toks[:-1])
        a.seqs[0].set_state(slice_seq_state(target.seqs[0].state(), 2), target.seqs[0].tokens)
        b.seqs[0].prefill(toks[:-1])
        assert np.array_equal(a.seqs[0].eval(toks, 1), b.seqs[0].eval(toks, 1).copy())


def test_incompatible_vocabularies_are_named(tiny_target, tiny_dir):
    other = make_tiny_gguf(tiny_dir / "other-vocab.gguf", blocks=1, seed=2, extra_tokens=4)
    with LlamaModel(tiny_target, PARAMS) as t, LlamaModel(other, PARAMS) as d:
        with pytest.raises(IncompatibleModelsError, match="EOS token differs"):
            check_compatible(t, d, "draft")


class FakeVocab:
    """Only for the pure compatibility rule; loading real models is covered above."""

    def __init__(self, n_vocab=300, texts=None, eos=2, path="x.gguf"):
        from pathlib import Path

        self.vocab_type, self.add_bos, self.bos, self.eos, self.n_vocab = 2, False, 1, eos, n_vocab
        self.path = Path(path)
        self._texts = texts or {}

    def token_text(self, t):
        return self._texts.get(t, f"tok{t}".encode())


def test_compatibility_rule_names_each_difference():
    check_compatible(FakeVocab(), FakeVocab(n_vocab=400), "draft")  # within 128: fine
    with pytest.raises(IncompatibleModelsError, match="sizes differ by more than 128"):
        check_compatible(FakeVocab(), FakeVocab(n_vocab=429), "draft")
    with pytest.raises(IncompatibleModelsError, match="token 77 differs"):
        check_compatible(FakeVocab(), FakeVocab(texts={77: b"other"}), "draft")
    check_compatible(FakeVocab(), FakeVocab(texts={3: b"other"}), "draft")  # ids below 5 are not compared


def test_f32_copy_of_a_quantized_model(tiny_q8, tmp_path, monkeypatch):
    import shutil

    from via_edge.weights.formats import build_f32

    src = tmp_path / "q8.gguf"
    shutil.copy(tiny_q8, src)
    f32 = build_f32(src)
    with monkeypatch.context() as m:
        m.setattr("via_edge.weights.formats.open_reader", no_reader)
        assert f32.parent == tmp_path and build_f32(src) == f32  # next to its source, reused unread
    assert {t.tensor_type.name for t in open_reader(f32).tensors} == {"F32"}
    with LlamaModel(src, PARAMS) as q, LlamaModel(f32, PARAMS) as f:
        toks = q.tokenize("dequantized weights compute the same model")
        assert (q.seqs[0].eval(toks, len(toks)).argmax(1) == f.seqs[0].eval(toks, len(toks)).argmax(1)).mean() > 0.8


def test_slim_build_never_overwrites_an_unrelated_file(tiny_target, tmp_path):
    from via_edge.errors import ModelFileError

    other = tmp_path / "mine.gguf"
    other.write_bytes(b"my own notes")
    with pytest.raises(ModelFileError, match="is not the slim 0-1"):
        build_slim(tiny_target, "0-1", other)
    assert other.read_bytes() == b"my own notes"
    built = build_slim(tiny_target, "0-1", tmp_path / "s.gguf")
    assert build_slim(tiny_target, "0-1", built) == built  # the very slim: reused
    with pytest.raises(ModelFileError, match="is not the slim 0-2"):
        build_slim(tiny_target, "0-2", built)


def test_bad_layer_sets_fail_before_weights_load(tiny_target, monkeypatch):
    from via_edge import Engine, llama
    from via_edge.errors import LayerSpecError

    loads = []
    monkeypatch.setattr(llama.LlamaModel, "__init__", lambda self, *a, **k: loads.append(a))
    with pytest.raises(LayerSpecError, match="out of range"):
        Engine(tiny_target, slim_layers="0-9", mode="via")
    assert loads == []
