"""The copy-aware drafter (`lookup`): its index, alignment and length policy on constructed
contexts, and lossless decoding with it on real models."""

import numpy as np
import pytest
from conftest import EXACT

from via_edge import Engine, SpecParams
from via_edge.decode.costs import tiled
from via_edge.decode.copying import MATCH_LIMIT, MEMORY_RUN, CopyDrafter, CopyPolicy
from via_edge.decode.sources import CopySource, NgramIndex
from via_edge.decode.memory import CopyMemory
from via_edge.decode.sampling import SamplingParams
from via_edge.decode.spec import NGRAM_LIMIT
from via_edge.errors import InvalidParameterError

GREEDY = SamplingParams()
FREE = SpecParams()  # default knobs: copy_max 63, ngram 1..12
SOURCE = list(range(100, 160))  # 60 distinct tokens: a "file" in the prompt


def free_policy() -> CopyPolicy:
    """Verification costs nothing extra per token: the policy drafts as far as the copy goes."""
    return CopyPolicy(lambda n: 1.0)


def propose(drafter, context, k=32, spec=FREE):
    return drafter.propose(context, k, GREEDY, None, spec).tokens


def test_index_built_incrementally_equals_one_built_from_scratch():
    rng = np.random.default_rng(0)
    tokens = list(rng.integers(0, 12, size=400))  # small alphabet: many repeated n-grams
    grown = NgramIndex(tokens[:7])
    for t in tokens[7:250]:
        grown.append(t)
    grown.extend(tokens[250:])
    fresh = NgramIndex(tokens)
    assert grown.snapshot() == fresh.snapshot()
    assert grown.tokens == tokens
    # and what it answers is the latest earlier occurrence of the longest suffix
    n, at = fresh.longest_match(NGRAM_LIMIT)
    suffix = tokens[-n:]
    starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == suffix]
    assert at == starts[-1] + n
    assert tokens[-n - 1:] not in [tokens[i:i + n + 1] for i in range(len(tokens) - n - 1)]  # n is the longest


def test_a_copy_continues_across_rounds():
    """After a fully accepted draft the copy goes on from where it left off, even where a fresh
    search for the context's end would pick another, later occurrence (the distractor)."""
    drafter = CopyDrafter(free_policy())
    spec = SpecParams(ngram_max=4)
    distractor = SOURCE[10:14] + [77, 78, 79]
    prompt = SOURCE + [3] + distractor + [4]
    ctx = prompt + SOURCE[:5]  # the answer starts copying the source
    assert propose(drafter, ctx, k=8, spec=spec) == SOURCE[5:13]
    ctx += SOURCE[5:13] + [SOURCE[13]]  # all 8 accepted, and the target's own token continues the copy
    assert NgramIndex(ctx).longest_match(4)[1] == len(SOURCE) + 1 + 4  # a fresh search: the distractor
    assert propose(drafter, ctx, k=8, spec=spec) == SOURCE[14:22]
    assert drafter.src == 14 and drafter.run == 5 + 9  # anchored on all 5 (past the 4-gram), then 9 copied


def test_a_rejection_re_anchors_on_the_longest_match():
    drafter = CopyDrafter(free_policy())
    other = [7, 8, 9, 101, 102, 55]  # an earlier, shorter occurrence of 101, 102
    prompt = other + SOURCE + [3]
    ctx = prompt + SOURCE[:10]
    assert propose(drafter, ctx, k=6) == SOURCE[10:16]
    # the target accepts 2, then writes an edit of its own (two new tokens), then resumes the source
    ctx += SOURCE[10:12] + [900, 901] + SOURCE[12:15]
    assert propose(drafter, ctx, k=6) == SOURCE[15:21]
    assert drafter.run == 3  # re-anchored on the 3-token suffix, the longest earlier occurrence
    # with a shorter suffix only, the latest earlier occurrence wins
    d2 = CopyDrafter(free_policy())
    assert propose(d2, [5, 6, 101, 102, 7, 101, 102, 8, 101], k=3) == [102, 8, 101]


def test_another_answers_text_is_drafted_once_it_matches_past_shared_boilerplate():
    """Spec-Bench answers share up to 12 tokens of boilerplate with earlier answers and then
    differ (section 51): a memory entry is drafted from once the answer has matched MEMORY_RUN
    tokens of it, and after a kept draft from it (or where the request's own text holds the same
    match) as soon as the policy finds a copy worth it. The context is drafted from at once."""
    question = [1, 2, 3]

    def fresh() -> CopyDrafter:
        drafter = CopyDrafter(free_policy())
        drafter.begin(question, [CopySource("memory", SOURCE)])
        return drafter

    assert MEMORY_RUN > 12
    drafter = fresh()
    assert propose(drafter, question + SOURCE[:12], k=4) == []  # 12 tokens: boilerplate so far
    assert propose(drafter, question + SOURCE[:MEMORY_RUN], k=4) == SOURCE[MEMORY_RUN:MEMORY_RUN + 4]
    drafter.accept(4)  # kept: this answer copies that entry
    ctx = question + SOURCE[:MEMORY_RUN + 4] + [900] + SOURCE[30:34]  # an edit, then the copy resumes
    assert propose(drafter, ctx, k=4) == SOURCE[34:38]
    both = CopyDrafter(free_policy())  # the request holds the text too: no boilerplate, drafted at once
    both.begin(SOURCE + question, [CopySource("memory", SOURCE)])
    assert propose(both, SOURCE + question + SOURCE[:4], k=4) == SOURCE[4:8] and both.at[0] == "memory"
    in_context = CopyDrafter(free_policy())
    in_context.begin(SOURCE + question)
    assert propose(in_context, SOURCE + question + SOURCE[:4], k=4) == SOURCE[4:8]


def test_an_anchor_counts_the_whole_match_not_just_the_indexed_ngram():
    """The run a copy starts with is how far back the context's end matches the source (up to
    MATCH_LIMIT), not the index's longest n-gram: the policy and the memory's MEMORY_RUN read it."""
    long_source = list(range(1000, 1100))
    drafter = CopyDrafter(free_policy())
    prompt = long_source + [5]
    assert propose(drafter, prompt + long_source[:40], k=4) == long_source[40:44]
    assert drafter.run == 40  # the index holds 12-grams; the match is 40 tokens long
    capped = CopyDrafter(free_policy())
    assert propose(capped, prompt + long_source[:90], k=4) == long_source[90:94]
    assert capped.run == MATCH_LIMIT


def test_a_repeated_request_drafts_its_earlier_answer_from_the_first_token():
    """A memory entry keeps its prompt's last tokens: a request that repeats that prompt (an agent
    asking for the same file again, with a change) drafts the earlier answer from its first
    token; one that only ends with the same instruction does not (edit requests all end "Return
    the whole edited file ..."): its answer must match MEMORY_RUN tokens of the entry first."""
    template = list(range(300, 320))       # a system prompt and the chat template's turn header
    instruction = list(range(400, 460))    # "write inventory.py with methods ..., return the whole module"
    ending = list(range(500, 520))         # the instruction's last words and the assistant header
    answer = list(range(600, 680))
    memory = CopyMemory(4096)
    memory.add(answer, lead=template + instruction + ending)
    assert memory.sources()[0].tokens[:32] == (instruction + ending)[-32:]

    again = CopyDrafter(free_policy())  # the same request with a few words changed in the middle
    asked = template + instruction[:30] + [901, 902] + instruction[32:] + ending
    again.begin(asked, memory.sources())
    assert propose(again, asked, k=8) == answer[:8] and again.run >= MEMORY_RUN

    other = CopyDrafter(free_policy())  # another request with the same ending
    asked = template + list(range(700, 760)) + ending
    other.begin(asked, memory.sources())
    assert propose(other, asked, k=8) == []
    assert propose(other, asked + answer[:MEMORY_RUN - 1], k=8) == []
    assert propose(other, asked + answer[:MEMORY_RUN], k=8) == answer[MEMORY_RUN:MEMORY_RUN + 8]


def test_no_match_proposes_nothing():
    drafter = CopyDrafter(free_policy())
    assert propose(drafter, list(range(50))) == []  # no token repeats
    assert propose(drafter, list(range(50)) + [3], spec=SpecParams(ngram_min=2)) == []  # only a 1-gram repeats
    assert propose(drafter, list(range(50)) + [3]) == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18,
                                                       19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31,
                                                       32, 33, 34, 35]


def test_a_context_that_does_not_extend_the_last_is_indexed_anew():
    drafter = CopyDrafter(free_policy())
    assert propose(drafter, SOURCE + SOURCE[:3], k=4) == SOURCE[3:7]
    fresh = CopyDrafter(free_policy())
    other = [1, 2, 3, 1, 2]
    assert propose(drafter, other, k=4) == propose(fresh, other, k=4) == [3, 1, 2]
    assert drafter.index.snapshot() == NgramIndex(other).snapshot()


def test_policy_drafts_long_on_reliable_copies_and_abstains_on_costly_short_ones():
    flat = CopyPolicy(lambda n: 1.0 + 0.05 * (n - 1))   # batches nearly free (AMX-like at small n)
    mid = CopyPolicy(lambda n: 1.0 + 0.25 * (n - 1))
    steep = CopyPolicy(lambda n: float(n))               # every drafted token costs a full step
    assert steep.length(run=40, k_max=32) == 0           # a copy can never pay when tokens cost n steps
    assert mid.length(run=1, k_max=32) == 0              # a one-token match has not earned a draft
    assert flat.length(run=40, k_max=32) > mid.length(run=40, k_max=32) > mid.length(run=4, k_max=32) > 0
    for _ in range(10):                                  # a copy that has held for 32 tokens at a time
        mid.observe(run=40, drafted=32, accepted=32)
    assert mid.length(run=40, k_max=32) == 32
    assert mid.length(run=40, k_max=5) == 5              # never past the cap


def test_beside_other_slots_a_draft_fills_the_tile_the_step_pays_for_and_no_more():
    """A tile-priced target (one token 1 step, 2..16 rows 2 steps, 17..32 rows 4): alone a fair
    copy drafts up to a full tile; beside 7 other slots' tokens only the 8 rows their step already
    pays for; beside 15 (a full tile) nothing, though the same copy pays alone."""
    def tiles(n: int) -> float:
        return 1.0 if n == 1 else 2.0 * -(-n // 16)
    policy = CopyPolicy(tiles)
    for _ in range(20):
        policy.observe(run=8, drafted=8, accepted=6)  # a copy that holds about 3 tokens in 4
    assert policy.length(run=8, k_max=32) == 15
    assert policy.length(run=8, k_max=32, others=7) == 8
    assert policy.length(run=8, k_max=32, others=15) == 0


def test_measured_tiles_price_the_sizes_between_and_a_reliable_copy_fills_the_cheap_tile():
    """Seconds per batch as measured on an AMD EPYC at 1.5k context (section 44): 64 rows cost
    what 48 do, 63 would cost a fifth more. Sizes between two measured ones are priced as the
    next, so a copy that always holds drafts 63 tokens (a 64-row verification), not 62 or 48."""
    seconds = {1: 0.0415, 2: 0.075, 4: 0.14, 8: 0.29, 16: 0.45, 32: 0.74, 48: 1.03, 64: 1.06}
    cost = tiled(seconds)
    assert cost(1) == 1.0
    assert cost(3) == cost(4) == pytest.approx(0.14 / 0.0415)
    assert cost(49) == cost(63) == cost(64) == pytest.approx(1.06 / 0.0415)
    assert cost(33) == pytest.approx(1.03 / 0.0415)  # 33..48 rows: the 48-row price
    assert cost(80) == pytest.approx((1.06 + 0.03) / 0.0415)  # extended past 64 along the last slope
    assert tiled({1: 1.0, 2: 3.0, 4: 2.0})(2) == 2.0  # a noisy dearer smaller batch: the bigger one's price
    policy = CopyPolicy(cost)
    for _ in range(10):
        policy.observe(run=100, drafted=63, accepted=63)
    assert policy.length(run=100, k_max=63) == 63
    assert policy.length(run=100, k_max=50) == 50  # a shorter copy left: all of it


def test_chance_anchors_failing_at_their_first_tokens_stop_long_drafts_that_real_copies_earned():
    """Section 49's agent follow-up: real copies anchored on 4 tokens held 31 tokens each, then
    4-token chance matches in new code failed at their first or second token. Each real copy
    passes runs 4, 5, 6 and 7; a bucket shared by runs 4-7 took four acceptances from it against
    one rejection per chance match, and kept drafting 63 tokens at every chance anchor (EPYC tile
    costs: 15 steps lost each time). Learned per run, the first tokens' failures show."""
    policy = CopyPolicy(tiled({1: 0.0415, 2: 0.075, 4: 0.14, 8: 0.29, 16: 0.45, 32: 0.74, 48: 1.03, 64: 1.06}))
    for _ in range(3):
        policy.observe(run=4, drafted=31, accepted=31)
    assert policy.length(run=4, k_max=63) == 63
    policy.observe(run=4, drafted=31, accepted=1)  # kept the anchor's next token, not the one after
    policy.observe(run=4, drafted=31, accepted=0)
    assert policy.length(run=4, k_max=63) < 8
    assert policy.p_accept(4) < policy.p_accept(6) == policy.p_accept(7)  # later runs keep what real copies taught
    assert policy.length(run=12, k_max=63) == 63  # a copy past its first tokens still drafts long


def test_each_request_starts_from_the_prior():
    """A request whose copies broke (an agent asking for type hints: every signature changes) must
    not make the next request, which copies the file whole, draft short (section 53)."""
    policy = CopyPolicy(tiled({1: 0.036, 2: 0.064, 4: 0.107, 8: 0.235, 16: 0.276, 32: 0.483, 64: 0.818}))  # EPYC, 256 ctx
    drafter = CopyDrafter(policy)
    fresh = policy.length(run=40, k_max=63)
    assert fresh > 0
    drafter.begin(SOURCE + [1])
    for _ in range(20):
        policy.observe(run=40, drafted=15, accepted=3)
    assert policy.length(run=40, k_max=63) < fresh
    drafter.begin(SOURCE + [2])  # the next request
    assert policy.length(run=40, k_max=63) == fresh
    assert [round(policy.p_accept(r), 6) for r in (1, 8, 40)] == [0.2, 0.85, 0.95]


def test_policy_learns_from_rejections():
    policy = CopyPolicy(lambda n: 1.0 + 0.25 * (n - 1))
    before = policy.length(run=8, k_max=32)
    assert before > 0
    for _ in range(40):
        policy.observe(run=8, drafted=before, accepted=0)  # this kind of copy is always rejected
    assert policy.p_accept(8) < 0.1
    assert policy.length(run=8, k_max=32) == 0
    for _ in range(40):
        policy.observe(run=8, drafted=8, accepted=8)  # and now it always holds again
    assert policy.length(run=8, k_max=32) > 0


def test_drafter_feeds_the_policy_what_the_target_accepted():
    policy = free_policy()
    drafter = CopyDrafter(policy)
    ctx = SOURCE + [1] + SOURCE[:4]
    drafted = propose(drafter, ctx, k=6)
    assert len(drafted) == 6
    before = [list(c) for c in policy.counts]
    drafter.accept(2)  # the loop's word: 2 accepted, then a correction
    changed = [(i, [round(x - y, 6) for x, y in zip(a, b)]) for i, (a, b) in enumerate(zip(policy.counts, before))
               if a != b]
    accepted = sum(d[0] for _, d in changed)
    rejected = sum(d[1] for _, d in changed)
    assert (accepted, rejected) == (2, 1)
    after = [list(c) for c in policy.counts]
    drafter.accept(2)  # a draft is learned from once
    assert policy.counts == after


@pytest.mark.parametrize("kw", [dict(copy_max=0), dict(copy_max=65), dict(ngram_min=0),
                                dict(ngram_max=NGRAM_LIMIT + 1), dict(ngram_min=5, ngram_max=4)])
def test_bad_knobs_are_one_clear_error(kw):
    with pytest.raises(InvalidParameterError, match="copy_max|ngram"):
        SpecParams(**kw)


# ---- on real models --------------------------------------------------------------------------
COPY_PROMPT = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
               "def mul(a, b):\n    return a * b\n\n")


def test_greedy_lookup_equals_ar_on_a_mostly_copied_prompt_tiny(tiny_target):
    """Tiny F32 model: its output from a prompt that repeats itself copies the prompt, so drafts
    of many tokens are accepted and rejected; every token stays the target's."""
    with Engine(tiny_target, **EXACT) as engine:
        prompt = " the cat is here and the cat is" * 6
        for copy_max in (1, 4, 32):
            ar = engine.generate(prompt, mode="ar", max_tokens=80, chat_template=False)
            engine.prepare("lookup")
            engine.models.batch_cost = lambda n: 1.0  # draft as far as the policy sees a copy
            res = engine.generate(prompt, mode="lookup", max_tokens=80, chat_template=False,
                                  spec=SpecParams(copy_max=copy_max))
            assert res.tokens == ar.tokens, copy_max
            assert res.stats.draft_n > 0
            if copy_max == 32:
                assert res.stats.copied_tokens > 0 and res.stats.rejected > 0
                assert res.stats.copied_tokens == res.origins.count("copy") == res.stats.draft_n_accepted


@pytest.mark.integration
def test_greedy_lookup_equals_ar_on_smollm2_edit(smollm2):
    """SmolLM2 with exact kernels, asked to repeat code it was given: most of the answer is
    copied, and the output is the target's token for token."""
    with Engine(smollm2, n_ctx=1024, use_extra_bufts=False) as engine:
        ask = "Repeat this code exactly, adding a one-line comment above each function:\n\n" + COPY_PROMPT
        ar = engine.generate(ask, mode="ar", max_tokens=64)
        res = engine.generate(ask, mode="lookup", max_tokens=64)
        assert res.tokens == ar.tokens
        assert res.stats.copied_tokens >= 10
        assert res.stats.rounds < len(res.tokens)  # fewer target calls than tokens


@pytest.mark.integration
def test_chat_colours_copied_tokens_and_counts_them(smollm2):
    """A second turn that asks to change the first turn's code copies from the history: the
    copied tokens come out cyan and /stats counts them."""
    import io

    from via_edge.chat import COLOURS, ChatSession
    from via_edge.decode.modes import COPY

    with Engine(smollm2, n_ctx=2048, mode="lookup") as engine:
        # a machine where verifying a batch costs little more than one token (an AMX Xeon measures
        # SmolLM2 so; a 2-core EPYC measures 4x at 8 tokens and rightly abstains): the display is tested here
        engine.models.batch_cost = lambda n: 1.0 + 0.05 * n
        out = io.StringIO()
        chat = ChatSession(engine, max_tokens=80, show_tiers=True, out=out)
        chat.ask("Repeat this code exactly:\n\n" + COPY_PROMPT)
        chat.ask("Now repeat the same code again, unchanged.")
        assert COLOURS[COPY] in out.getvalue()
        assert chat.stats.copied_tokens > 0
        assert f"copied {chat.stats.copied_tokens} (" in chat.stats_text()


def test_the_loop_tells_the_drafter_what_it_kept(tiny_target):
    """`accept(n)` after each verified round, n the draft tokens the context kept: over a greedy
    generation (lossless, so every committed copy token is an accepted draft token) the accepted
    counts add up to the copied tokens, and rejected drafts are reported short."""
    from via_edge.decode.loop import Decoder
    from via_edge.decode.scores import ScoredModel
    from via_edge.decode.stats import Stats

    class Listening(CopyDrafter):
        def propose(self, *args, **kw):
            draft = super().propose(*args, **kw)
            if draft.tokens:
                proposed.append(len(draft.tokens))
            return draft

        def accept(self, n_accepted):
            heard.append(n_accepted)
            super().accept(n_accepted)

    proposed, heard = [], []
    with Engine(tiny_target, **EXACT) as engine:
        prompt = engine.tokens_for(" the cat is here and the cat is" * 6, chat_template=False)
        engine.target.reset()
        decoder = Decoder(ScoredModel(engine.target), Listening(free_policy()), spec=SpecParams(copy_max=32))
        out = list(decoder.generate(prompt, "lookup", GREEDY, 80, Stats()))
    assert len(heard) == len(proposed) > 0
    assert sum(heard) == sum(c.origin == "copy" for c in out)
    assert all(0 <= n <= k for n, k in zip(heard, proposed)) and any(n < k for n, k in zip(heard, proposed))
