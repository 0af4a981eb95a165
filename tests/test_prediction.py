"""Predicted Outputs and the copy memory: copy sources beside the context. Drafting from them
never changes the answer (greedy: token for token; sampled: the target's distribution), and
they are what drafting prefers where the context matches as well."""

import subprocess
import sys

import numpy as np
import pytest
from conftest import EXACT
from test_decoding import dist, fit

from via_edge import Engine, SpecParams
from via_edge.decode.copying import CopyDrafter, CopyPolicy
from via_edge.decode.memory import LEAD, MIN_TOKENS, CopyMemory
from via_edge.decode.modes import COPY
from via_edge.decode.sampling import SamplingParams
from via_edge.decode.sources import CopySource
from via_edge.errors import InvalidParameterError
from via_edge.prediction import shared_tokens

GREEDY = SamplingParams()
SOURCE = list(range(100, 160))


def propose(drafter, context, k=32):
    return drafter.propose(context, k, GREEDY, None, SpecParams()).tokens


def test_a_prediction_wins_a_tie_with_the_prompt_and_serves_where_the_prompt_has_no_copy():
    """The prompt holds the file and the prediction holds the edited file: where both match the
    context's end equally, the copy comes from the prediction (it has the edit)."""
    edited = SOURCE[:20] + [7, 8, 9] + SOURCE[20:]
    drafter = CopyDrafter(CopyPolicy(lambda n: 1.0))
    drafter.begin(SOURCE + [1], [CopySource("prediction", edited)])
    assert propose(drafter, SOURCE + [1] + SOURCE[:20], k=5) == [7, 8, 9] + SOURCE[20:22]
    assert drafter.at[0] == "prediction"
    # without the prediction the prompt's copy would have gone on unchanged
    plain = CopyDrafter(CopyPolicy(lambda n: 1.0))
    assert propose(plain, SOURCE + [1] + SOURCE[:20], k=5) == SOURCE[20:25]
    # a prompt that holds nothing of it: the prediction alone
    other = CopyDrafter(CopyPolicy(lambda n: 1.0))
    other.begin([1, 2], [CopySource("prediction", SOURCE)])
    assert propose(other, [1, 2] + SOURCE[:3], k=4) == SOURCE[3:7]


def test_an_answer_meets_the_prediction_after_a_preamble():
    """The answer opens with a fence, then the file: in the prompt the file follows a newline, so
    the context matches one token further back than the prediction, which starts at the file.
    The match at the prediction's start is cut by its beginning, not by a mismatch: it wins."""
    fence, nl = [5, 6], 7
    prompt = [1, 2, nl] + SOURCE + [3]
    drafter = CopyDrafter(CopyPolicy(lambda n: 1.0))
    drafter.begin(prompt, [CopySource("prediction", SOURCE)])
    assert propose(drafter, prompt + fence + [nl] + SOURCE[:2], k=4) == SOURCE[2:6]
    assert drafter.at[0] == "prediction" and drafter.src == 2


def test_the_prediction_is_read_where_the_prompt_s_longer_copy_goes_on_with_the_same_text():
    """The prompt shows the file after a fence, and the answer opens with the same fence: the
    prompt matches several tokens further back than the prediction's start, but both go on with
    the same text, so the copy is the prediction's."""
    fence = [5, 6, 7]
    prompt = [1, 2] + fence + SOURCE + [3]
    drafter = CopyDrafter(CopyPolicy(lambda n: 1.0))
    drafter.begin(prompt, [CopySource("prediction", SOURCE)])
    assert propose(drafter, prompt + fence + SOURCE[:1], k=4) == SOURCE[1:5]
    assert drafter.at[0] == "prediction" and drafter.run == 4  # the fence and the file's first token


def test_a_longer_match_in_the_context_beats_a_short_one_in_the_prediction():
    drafter = CopyDrafter(CopyPolicy(lambda n: 1.0))
    prompt = SOURCE + [1]
    drafter.begin(prompt, [CopySource("prediction", [SOURCE[9], 500, 501, 502])])
    assert propose(drafter, prompt + SOURCE[:10], k=3) == SOURCE[10:13]  # 10 tokens matched against 1
    assert drafter.at[0] == "context"


def test_accepted_prediction_tokens_count_what_of_the_prediction_is_in_the_answer():
    answer = list(range(40))
    assert shared_tokens(answer, answer) == 40
    edited = answer[:10] + [900, 901] + answer[10:30] + [902] + answer[31:]  # two inserted, one changed
    assert shared_tokens(edited, answer) == 39
    assert shared_tokens([900, 901], answer) == 0


def test_copy_memory_bounds_and_order():
    mem = CopyMemory(max_tokens=100, max_entries=3)
    a, b, c, d = (list(range(i * 1000, i * 1000 + 30)) for i in range(1, 5))
    mem.add(a)
    mem.add(b)
    mem.add(list(range(MIN_TOKENS - 1)))  # too short to be worth an entry
    assert [s.tokens for s in mem.sources()] == [b, a]
    mem.add(a)  # again: moved to the front, not kept twice
    assert [s.tokens for s in mem.sources()] == [a, b]
    mem.add(c)
    mem.add(d)  # a fourth entry: the oldest (b) goes
    assert [s.tokens for s in mem.sources()] == [d, c, a] and mem.tokens == 90
    mem.add(list(range(5000, 5050)))  # 50 more tokens: over 100, so the two oldest go
    assert len(mem) == 2 and mem.tokens == 80
    mem.add(list(range(6000, 6300)))  # longer than the whole memory: its end is kept
    assert [s.tokens for s in mem.sources()] == [list(range(6200, 6300))]
    led = CopyMemory(max_tokens=100)
    led.add(list(range(7000, 7000 + MIN_TOKENS - 1)), lead=list(range(50)))  # a short answer, however long its prompt
    assert len(led) == 0
    led.add(a, lead=list(range(50)))  # the prompt's last LEAD tokens lead the answer, and count
    assert led.sources()[0].tokens == list(range(50 - LEAD, 50)) + a and led.tokens == LEAD + 30
    assert led.sources()[0].lead == LEAD
    led.add(list(range(8000, 8090)), lead=list(range(50)))  # over the bound: the lead goes first
    assert led.sources()[0].tokens == list(range(40, 50)) + list(range(8000, 8090)) and led.sources()[0].lead == 10
    off = CopyMemory(0)
    off.add(a)
    assert len(off) == 0
    with pytest.raises(InvalidParameterError):
        Engine("unused.gguf", copy_memory=-1)  # refused before anything loads


@pytest.fixture(scope="module")
def tiny(tiny_target):
    with Engine(tiny_target, draft_layers="0-1", slim_layers="0-2", copy_memory=0, **EXACT) as engine:
        for mode in ("sd", "lookup", "hier", "via"):
            engine.prepare(mode)
        engine.models.batch_cost = lambda n: 1.0  # draft as far as the policy sees a copy
        yield engine


def edited(tokens, n_vocab):
    """The answer as an editor might predict it: a changed span, an inserted one, a cut tail."""
    other = [(t * 7 + 3) % n_vocab for t in tokens[12:16]]
    return tokens[:12] + other + tokens[16:30] + [5, 6, 7] + tokens[30:50]


@pytest.mark.parametrize("mode", ["ar", "lookup", "sd", "hier"])
def test_greedy_answer_is_the_same_with_and_without_a_prediction(tiny, mode):
    prompt = tiny.tokens_for("hello world", False)
    plain = tiny.generate(prompt, mode=mode, max_tokens=60)
    pred = edited(plain.tokens, tiny.target.n_vocab)
    res = tiny.generate(prompt, mode=mode, max_tokens=60, prediction=pred)
    assert res.tokens == plain.tokens
    s = res.stats
    assert s.prediction_draft_n_accepted > 20 and s.prediction_draft_n > s.prediction_draft_n_accepted
    assert s.prediction_accepted == shared_tokens(pred, plain.tokens) and s.prediction_rejected == 7
    assert plain.stats.prediction_draft_n == 0 and plain.stats.prediction_accepted == 0
    # a prediction that has nothing to do with the answer changes nothing either
    junk = [(t * 13 + 1) % tiny.target.n_vocab for t in plain.tokens]
    assert tiny.generate(prompt, mode=mode, max_tokens=60, prediction=junk).tokens == plain.tokens


def test_via_drafts_a_prediction_for_the_target_to_verify(tiny):
    prompt = tiny.tokens_for("hello world", False)
    plain = tiny.generate(prompt, mode="ar", max_tokens=40)
    res = tiny.generate(prompt, mode="via", max_tokens=40, prediction=plain.tokens)
    assert res.stats.prediction_draft_n_accepted > 20
    assert res.tokens[:res.stats.prediction_draft_n_accepted] == plain.tokens[:res.stats.prediction_draft_n_accepted]


def test_seeded_sampling_with_a_prediction_is_ar_s(tiny):
    """A copied token is kept only when the target's own draw is it (Decoder._verify), so a
    seeded `ar` or `lookup` answer is the same with a prediction: one draw per committed token."""
    prompt = tiny.tokens_for("hello world", False)
    for seed in range(3):
        plain = tiny.generate(prompt, mode="ar", max_tokens=40, temperature=0.7, seed=seed)
        for mode in ("ar", "lookup"):
            res = tiny.generate(prompt, mode=mode, max_tokens=40, temperature=0.7, seed=seed,
                                prediction=plain.tokens)
            assert res.tokens == plain.tokens and res.stats.prediction_draft_n_accepted > 0, (seed, mode)


@pytest.mark.slow
def test_sampled_sd_with_a_prediction_follows_the_target(tiny):
    """sd with a prediction drafts the copy first (a point mass), else the draft model: the first
    token must follow the target's softmax (chi-square at p = 0.001), and the statistic rejects
    the copy's point mass, so a rule that kept every copy would fail."""
    sp = dict(temperature=2.0)
    prompt = tiny.tokens_for("hello world", False)
    p = dist(tiny.models.target.seqs[0].eval(prompt, 1)[0], SamplingParams(**sp)).dense(tiny.target.n_vocab)
    copy = int(p.argmax())
    assert 0.05 < p[copy] < 0.9  # both the accept and the residual paths run often
    n, firsts, drafted = 4000, [], 0
    for i in range(n):
        res = tiny.generate(prompt, mode="sd", max_tokens=2, seed=i, prediction=[copy] * 3, **sp)
        firsts.append(res.tokens[0])
        drafted += res.stats.prediction_draft_n > 0
    counts = np.bincount(firsts, minlength=p.size)
    assert drafted == n
    assert fit(p, counts) > 0.001
    point = np.zeros_like(p)
    point[copy] = 1.0
    assert fit(0.5 * p + 0.5 * point, counts) < 0.001


def test_a_repeated_request_is_drafted_from_the_memory_from_its_first_token(tiny_target):
    """The engine keeps each answer after its prompt's end: asked again with a word changed, the
    earlier answer is drafted from the first token; an unrelated request is not drafted from it
    until its own answer matches 16 tokens of it."""
    words = " ".join(f"w{i}" for i in range(60))
    with Engine(tiny_target, copy_memory=4096, **EXACT) as engine:
        engine.prepare("lookup")
        engine.models.batch_cost = lambda n: 1.0
        engine.generate(f"list: {words} end", mode="ar", max_tokens=40, chat_template=False)
        again = engine.generate(f"list: {words.replace('w30', 'x30')} end", mode="lookup", max_tokens=40,
                                chat_template=False)
        assert again.origins[0] == COPY and again.stats.memory_draft_n_accepted > 0
        plain = engine.generate(f"list: {words.replace('w30', 'x30')} end", mode="ar", max_tokens=40,
                                chat_template=False)
        assert again.tokens == plain.tokens  # drafted from another answer, still the target's own
        other = engine.generate("a different request", mode="lookup", max_tokens=40, chat_template=False)
        assert other.origins[0] != COPY


def test_the_copy_memory_drafts_an_answer_given_before_and_changes_nothing(tiny_target):
    """An agent asks again without the history: the second answer is copied from the memory."""
    with Engine(tiny_target, copy_memory=4096, **EXACT) as engine:
        engine.prepare("lookup")
        engine.models.batch_cost = lambda n: 1.0
        first = engine.generate("hello world", mode="ar", max_tokens=60, chat_template=False)
        again = engine.generate("hello world", mode="lookup", max_tokens=60, chat_template=False)
        assert again.tokens == first.tokens
        assert again.stats.memory_draft_n_accepted > 30
        assert len(engine.memory) == 1  # the same answer twice is one entry
        engine.reset()
        assert len(engine.memory) == 0
    with Engine(tiny_target, copy_memory=0, **EXACT) as engine:
        engine.prepare("lookup")
        engine.models.batch_cost = lambda n: 1.0
        engine.generate("hello world", mode="ar", max_tokens=60, chat_template=False)
        again = engine.generate("hello world", mode="lookup", max_tokens=60, chat_template=False)
        assert again.stats.memory_draft_n == 0 and len(engine.memory) == 0


def test_bad_predictions_are_named(tiny):
    with pytest.raises(InvalidParameterError) as exc:
        tiny.request("hi", prediction=[1, -5])
    assert exc.value.param == "prediction"
    with pytest.raises(InvalidParameterError) as exc:
        tiny.request("hi", prediction=list(range(10)) * 60)  # 600 tokens, the window holds 512
    assert exc.value.param == "prediction" and "context window" in str(exc.value)
    assert tiny.request("hi", prediction="").prediction is None


def test_generate_reads_a_prediction_file(tiny_target, tmp_path):
    pred = tmp_path / "pred.txt"
    pred.write_text(" the cat is here" * 20)
    cli = [sys.executable, "-m", "via_edge", "generate", "the cat is here", "--target", str(tiny_target), "--raw",
           "-n", "30", "--json", "--exact", "--kv-type", "f32", "--no-flash-attn"]
    out = subprocess.run(cli + ["--prediction-file", str(pred)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert '"prediction_draft_n"' in out.stdout
    missing = subprocess.run(cli + ["--prediction-file", str(tmp_path / "none.txt")], capture_output=True,
                             text=True, timeout=120)
    assert missing.returncode == 2 and "cannot read --prediction-file" in missing.stderr
    assert "Traceback" not in missing.stderr
