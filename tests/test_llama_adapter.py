"""The llama.cpp adapter on real llama.cpp with tiny GGUFs."""

import os
import threading
from dataclasses import replace

import numpy as np
import pytest

from via_edge.decode.text import StreamDecoder
from via_edge.errors import ContextOverflowError, ModelFileError
from via_edge.llama import LlamaModel, LoadParams, common_prefix
from via_edge.prompts import render_chat
from via_edge.weights.gguf_info import read_info

PARAMS = LoadParams(n_ctx=256, kv_type="f32", flash_attn=False, use_extra_bufts=False)
TEXT = "Hello the world, héllo 世界 🎉 and some more text for the test"


@pytest.fixture(scope="module")
def model(tiny_target):
    with LlamaModel(tiny_target, PARAMS) as m:
        yield m


def test_header_facts(tiny_target, tiny_llama):
    info = read_info(tiny_target)
    assert (info.architecture, info.block_count, info.vocab_size) == ("qwen2", 4, 279)
    assert info.context_length == 512 and not info.tied_embeddings
    assert read_info(tiny_llama).tied_embeddings and read_info(tiny_llama).architecture == "llama"


def test_loaded_facts(model):
    assert model.n_vocab == 279 and model.n_layer == 4 and model.n_ctx == 256
    assert model.is_eog(model.eos) and not model.is_eog(5)


def test_batch_equals_one_by_one(model):
    toks = model.tokenize(TEXT)
    model.reset()
    batched = model.seqs[0].decode(toks, "all").copy()
    model.reset()
    single = np.stack([model.seqs[0].decode([t])[0].copy() for t in toks])
    assert np.abs(batched - single).max() < 1e-4


def test_quantized_model_decodes(tiny_q8):
    with LlamaModel(tiny_q8, PARAMS) as m:
        rows = m.seqs[0].decode(m.tokenize("quantized weights"), "all")
        assert rows.shape == (len(m.seqs[0].tokens), m.n_vocab) and np.isfinite(rows).all()


def test_rollback_then_redecode(model):
    toks = model.tokenize(TEXT)
    model.reset()
    first = model.seqs[0].decode(toks, "all").copy()
    model.seqs[0].truncate(10)
    assert model.seqs[0].n_past == 10 and model.seqs[0].tokens == toks[:10]
    again = model.seqs[0].decode(toks[10:], "all")
    assert np.abs(again - first[10:]).max() < 1e-4


def test_eval_reuses_prefix_and_rolls_back(model):
    toks = model.tokenize(TEXT)
    model.reset()
    ref = model.seqs[0].eval(toks, 3).copy()
    calls = model.usage.tokens
    same = model.seqs[0].eval(toks, 3)  # only the last 3 positions are re-decoded
    assert model.usage.tokens - calls == 3
    assert np.abs(same - ref).max() < 1e-4
    other = toks[:8] + [40, 41, 42]
    got = model.seqs[0].eval(other, 1).copy()
    model.reset()
    fresh = model.seqs[0].eval(other, 1)
    assert np.abs(got - fresh).max() < 1e-4 and model.seqs[0].tokens == other


def test_decode_observers_see_each_decode_on_the_context_it_extended(model):
    """Tools time decodes through `observers` instead of patching the adapter: one call per
    llama_decode, with the sequence still at the length it was decoded on."""
    toks = model.tokenize(TEXT)
    model.reset()
    model.seqs[0].eval(toks[:5], 1)
    heard = []
    model.observers.append(lambda parts, s: heard.append((len(parts[0][0].tokens), [len(c) for _, c, _ in parts], s)))
    try:
        model.seqs[0].eval(toks[:9], 2)
        model.seqs[0].eval(toks[:9] + [40], 1)
    finally:
        model.observers.clear()
    assert [(n, sizes) for n, sizes, _ in heard] == [(5, [4]), (9, [1])]
    assert all(s > 0 for _, _, s in heard)


def test_logits_are_views_until_the_next_decode(model):
    """Rows are read-only views onto llama.cpp's buffer: no copy per row, and a view is overwritten
    by the model's next decode. The drafter reads each row before it decodes again, so its
    proposal equals one built from copies on a fresh model."""
    from via_edge.decode.drafters import ModelDrafter
    from via_edge.decode.sampling import SamplingParams
    from via_edge.decode.scores import ScoredModel
    from via_edge.decode.spec import SpecParams

    toks = model.tokenize(TEXT)
    model.reset()
    row = model.seqs[0].eval(toks, 1)
    saved = row.copy()
    assert not row.flags.writeable
    model.seqs[0].decode([int(saved[0].argmax())])
    assert not np.array_equal(row, saved)  # the hazard is real
    model.reset()
    got = ModelDrafter(ScoredModel(model)).propose(toks, 6, SamplingParams(), None, SpecParams(n_draft=6)).tokens
    model.reset()
    ctx, want = list(toks), []
    for _ in range(6):
        want.append(int(model.seqs[0].eval(ctx, 1)[0].copy().argmax()))
        ctx.append(want[-1])
    assert got == want


def test_tokenizer_round_trip(model):
    for text in [TEXT, "naïve café ß", "日本語のテキスト", "emoji 👩‍💻 zwj", "  spaces\tand\nlines  "]:
        assert model.detokenize(model.tokenize(text, add_special=False)) == text


def test_special_tokens_parse_only_when_asked(model):
    as_text = model.tokenize("<|im_end|>", add_special=False, parse_special=False)
    special = model.tokenize("<|im_end|>", add_special=False, parse_special=True)
    assert special == [model.eos] and len(as_text) > 1


def test_stream_decoder_never_splits_characters(model):
    dec = StreamDecoder()
    pieces = [dec.feed(model.token_bytes(t)) for t in model.tokenize("世界 🎉", add_special=False)]
    pieces.append(dec.flush())
    assert "".join(pieces) == "世界 🎉"
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some tokens carried only part of a character and waited


def test_chat_template_from_gguf(model):
    text = render_chat(model.chat_template, [{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_context_overflow(model):
    model.reset()
    model.seqs[0].eval(model.tokenize(TEXT), 1)
    held = list(model.seqs[0].tokens)
    with pytest.raises(ContextOverflowError):
        model.seqs[0].decode(list(range(5, 5 + 300)), "last")
    assert model.seqs[0].tokens == held


def test_a_decode_failing_after_writing_the_cache_rolls_it_back(tiny_target):
    """A batch of three ubatches whose compute is aborted in the second: llama.cpp has written
    the first ubatch's KV by then and removes only the failed ubatch's positions, so the adapter
    must roll back the rest. Afterwards the cache holds exactly what it held, and the next eval
    computes what a fresh context does."""
    import ctypes

    import llama_cpp

    with LlamaModel(tiny_target, replace(PARAMS, n_ubatch=8, n_threads=1)) as m:
        toks = m.tokenize(TEXT)
        more = list(range(40, 60))  # 20 tokens: ubatches of 8, 8 and 4
        m.seqs[0].eval(toks, 1)
        nodes = []
        counting = llama_cpp.ggml_abort_callback(lambda _data: nodes.append(1) is not None)
        llama_cpp.llama_set_abort_callback(m._ctx, counting, None)
        m.seqs[0].decode(more[:8], "none")  # one ubatch: how many graph nodes ask the callback
        per_ubatch = len(nodes)
        m.seqs[0].truncate(len(toks))
        nodes.clear()

        def second_ubatch_aborts(_data) -> bool:
            nodes.append(1)
            return len(nodes) > per_ubatch

        aborting = llama_cpp.ggml_abort_callback(second_ubatch_aborts)
        llama_cpp.llama_set_abort_callback(m._ctx, aborting, None)
        with pytest.raises(RuntimeError, match="llama_decode failed"):
            m.seqs[0].decode(more, "last")
        assert len(nodes) == per_ubatch + 1 and m.seqs[0].tokens == toks
        llama_cpp.llama_set_abort_callback(m._ctx, ctypes.cast(None, llama_cpp.ggml_abort_callback), None)
        after = m.seqs[0].eval(toks + [9, 10], 1).copy()
        m.reset()
        assert np.abs(after - m.seqs[0].eval(toks + [9, 10], 1)).max() < 1e-4
        # the cache holds no stray cells: the sequence's positions end where its tokens end
        assert llama_cpp.llama_memory_seq_pos_max(m._mem, 0) == len(toks) + 1


@pytest.mark.parametrize("which", ["tiny_target", "tiny_llama", "smollm2"])
def test_the_header_scan_reads_what_gguf_py_reads(which, request):
    """read_info's own header scan against gguf-py's full reader, on tiny models and on SmolLM2's
    49,152-token vocabulary (long string arrays are counted, not decoded)."""
    from via_edge.weights.gguf_info import field_value, open_reader, scan_header

    path = request.getfixturevalue(which)
    fields, names = scan_header(path)
    reader = open_reader(path)
    assert names == {t.name for t in reader.tensors}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field_value(reader, key)
        got = fields[key]
        if isinstance(want, list) and len(want) > 1024:
            assert got == len(want), key
        elif isinstance(want, float):
            assert got == pytest.approx(want), key
        else:
            assert got == want, key
    info = read_info(path)
    assert info.vocab_size == len(reader.fields["tokenizer.ggml.tokens"].data) > 0
    from via_edge.weights import gguf_info

    gguf_info._stored_header.cache_clear()  # a new process: the scan comes from the disk copy
    assert scan_header(path) == (fields, names) == gguf_info._scan_header(*gguf_info._file_key(path))


def test_a_damaged_header_is_one_clear_message(tmp_path, tiny_target):
    data = tiny_target.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:4] + b"\x03\x00\x00\x00" + b"\xff" * 16 + data[24:200])  # absurd counts
    with pytest.raises(ModelFileError, match="corrupt or truncated"):
        read_info(bad)
    header_only = tmp_path / "header-only.gguf"
    header_only.write_bytes(data[:3000])
    with pytest.raises(ModelFileError, match="truncated"):
        read_info(header_only)


def test_missing_foreign_and_truncated_files(tmp_path, tiny_target):
    with pytest.raises(ModelFileError, match="not found"):
        LlamaModel(tmp_path / "nope.gguf", PARAMS)
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ModelFileError, match="not a GGUF"):
        LlamaModel(foreign, PARAMS)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_target.read_bytes()[: tiny_target.stat().st_size // 2])
    with pytest.raises(ModelFileError, match="truncated"):
        LlamaModel(cut, PARAMS)


def test_common_prefix():
    a = list(range(3000))
    assert common_prefix(a, a) == 3000
    assert common_prefix(a, a[:1500] + [-1]) == 1500
    assert common_prefix(a, a[:2990] + [-1]) == 2990
    assert common_prefix([], a) == 0



def _native_threads() -> int:
    """OS threads Python did not start: OpenMP's team workers among them."""
    return len(os.listdir("/proc/self/task")) - threading.active_count()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_decodes_from_many_threads_share_one_openmp_team(tiny_target):
    """libgomp gives every thread that decodes a team of its own; with more team threads than
    CPUs its barriers sleep instead of spinning (half speed measured on the AMX build). Decodes
    from any thread must run on one compute thread, so callers add no teams."""
    with LlamaModel(tiny_target, replace(PARAMS, n_threads=2)) as m:
        toks = m.tokenize(TEXT)
        m.seqs[0].decode(toks[:4])
        before = _native_threads()
        decoded, release = threading.Barrier(4), threading.Event()

        def caller(i: int) -> None:
            m.seqs[0].decode(toks[4 + i:5 + i])
            decoded.wait()
            release.wait()  # alive while counted: a thread's team ends with the thread

        callers = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
        for t in callers:
            t.start()
        decoded.wait()
        after = _native_threads()
        release.set()
        for t in callers:
            t.join()
        assert m.seqs[0].tokens[:4] == toks[:4] and sorted(m.seqs[0].tokens[4:]) == sorted(toks[4:7])  # in any order
    assert after == before
