"""Grammar-constrained decoding in every mode: output that obeys the grammar, the same greedy
output in every lossless mode, sampled output from the target's distribution restricted to what
the grammar allows, and one clear error for a grammar or format that cannot be used."""

import json
import re

import numpy as np
import pytest
from test_decoding import engines, fit  # noqa: F401  (the tiny engines fixture)

from via_edge import Engine, SpecParams
from via_edge.decode.sampling import SamplingParams, dist
from via_edge.errors import InvalidParameterError

PROMPTS = ["hello world", "the cat is here", "a", "some more words in here", "xyz 123"]
LETTERS = 'root ::= [a-e]{3,12} "."'   # then only the end of generation is allowed
SHAPE = re.compile(r"[a-e]{3,12}\.")


def run(engine, prompt, mode, **kw):
    kw.setdefault("max_tokens", 40)
    return engine.generate(prompt, mode=mode, chat_template=False, **kw)


def test_greedy_constrained_output_is_the_same_in_every_lossless_mode(engines):
    rejected = 0
    for engine in engines:
        for prompt in PROMPTS:
            ar = run(engine, prompt, "ar", grammar=LETTERS)
            assert SHAPE.fullmatch(ar.text) and ar.finish_reason == "stop", ar.text
            assert ar.text != run(engine, prompt, "ar").text  # the grammar changed the answer
            for mode in ("sd", "hier", "lookup"):
                res = run(engine, prompt, mode, grammar=LETTERS, spec=SpecParams(n_draft=4))
                assert res.tokens == ar.tokens, (mode, prompt)
                rejected += res.stats.rejected if mode == "sd" else 0
    assert rejected > 0  # drafts the grammar forbids were turned down at verification


@pytest.mark.parametrize("spec", [dict(tau_accept=0.0, tau_full=0.0), dict(route="draft", tau_accept=0.5, tau_full=0.2),
                                  dict(tau_accept=0.6, tau_full=0.3)])
def test_via_keeps_the_grammar_whichever_tier_decides(engines, spec):
    """via commits tokens the target never saw (tiers A and B): those obey the grammar too."""
    unverified = 0
    for engine in engines:
        for prompt in PROMPTS:
            res = run(engine, prompt, "via", grammar=LETTERS, spec=SpecParams(**spec))
            assert SHAPE.fullmatch(res.text), (spec, res.text)
            unverified += res.stats.tier_a + res.stats.tier_b
    assert unverified > 0


def test_sampled_constrained_output_obeys_the_grammar(engines):
    engine = engines[0]
    for mode in ("ar", "sd", "hier", "lookup", "via"):
        for seed in range(8):
            res = run(engine, "the cat is here", mode, grammar=LETTERS, temperature=1.5, seed=seed)
            assert SHAPE.fullmatch(res.text), (mode, seed, res.text)


def test_sampled_sd_draws_from_the_grammar_restricted_distribution(engines):
    """First token of sampled sd against the target's softmax over the allowed tokens only
    (chi-square at p = 0.001); the unrestricted softmax must be rejected by the same statistic."""
    engine = engines[0]
    engine.prepare("sd")
    sp = SamplingParams(temperature=4.0)
    tokens = engine.tokens_for("the cat is here", False)
    row = np.array(engine.models.target.seqs[0].eval(tokens, 1)[0])
    allowed = engine.target.grammar('root ::= [a-p] [a-p]').mask(row)
    p = dist(allowed, sp).dense(engine.target.n_vocab)
    free = dist(row, sp).dense(engine.target.n_vocab)
    assert free[np.isfinite(allowed)].sum() < 0.5 and (p > 0.02).sum() >= 5  # mass removed; a real choice left
    n = 3000
    firsts = [engine.generate(tokens, mode="sd", max_tokens=2, seed=i, temperature=4.0, grammar="root ::= [a-p] [a-p]",
                              spec=SpecParams(n_draft=3)).tokens[0] for i in range(n)]
    counts = np.bincount(firsts, minlength=p.size)
    assert fit(p, counts) > 0.001
    assert fit(free, counts) < 0.001


def test_a_json_schema_gives_json_that_validates(smollm2):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                        "maxItems": 3}},
              "required": ["name", "age", "tags"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    with Engine(smollm2, n_ctx=1024) as engine:
        texts = {}
        for mode in ("ar", "lookup"):
            res = engine.generate("Describe a person called Ann as JSON.", mode=mode, max_tokens=120,
                                  response_format=fmt)
            texts[mode] = res.text
            data = json.loads(res.text)
            assert set(data) == {"name", "age", "tags"}
            assert isinstance(data["name"], str) and len(data["name"]) <= 16
            assert isinstance(data["age"], int) and 0 <= data["age"] <= 150
            assert all(t in ("a", "b") for t in data["tags"]) and len(data["tags"]) <= 3
        plain = engine.generate("Say hi as a JSON object.", max_tokens=120, response_format={"type": "json_object"})
        assert plain.text.startswith("{")  # an object, complete unless the answer ran out of tokens
        assert plain.finish_reason == "length" or isinstance(json.loads(plain.text), dict)


def test_grammar_errors_are_one_clear_message(tiny_engine):
    with pytest.raises(InvalidParameterError, match="does not parse"):
        tiny_engine.generate("x", grammar="root ::= [a-", chat_template=False)
    # the parser's own words, which llama.cpp prints to stderr only, are in the message
    with pytest.raises(InvalidParameterError, match="does not parse as GBNF: Undefined rule identifier 'word'"):
        tiny_engine.generate("x", grammar="root ::= word", chat_template=False)
    with pytest.raises(InvalidParameterError, match="json_schema"):
        tiny_engine.generate("x", response_format={"type": "xml"}, chat_template=False)
    with pytest.raises(InvalidParameterError, match="not both"):
        tiny_engine.generate("x", grammar=LETTERS, response_format={"type": "json_object"}, chat_template=False)
    with pytest.raises(InvalidParameterError, match="schema"):
        tiny_engine.generate("x", response_format={"type": "json_schema", "json_schema": {"schema": 3}},
                             chat_template=False)


def reference_greedy(model, prompt, n, bias={}, presence=0.0, frequency=0.0, repeat=1.0):
    """Greedy decoding one token per call, the logit rules written out from their definitions:
    bias added; the repeat penalty over the context's last 64 tokens (positive logits divided,
    negative multiplied); presence and frequency over the answer so far."""
    model.reset()
    ctx, out = list(prompt), []
    for _ in range(n):
        row = np.array(model.seqs[0].eval(ctx, 1)[0], dtype=np.float64)
        for t, b in bias.items():
            row[t] += b
        for t in set(ctx[-64:]):
            row[t] = row[t] / repeat if row[t] > 0 else row[t] * repeat
        for t in set(out):
            row[t] -= presence + frequency * out.count(t)
        tok = int(row.argmax())
        out.append(tok)
        ctx.append(tok)
        if model.is_eog(tok):
            break
    return out


@pytest.mark.parametrize("rules", [dict(frequency_penalty=1.5), dict(presence_penalty=2.0, repeat_penalty=1.3),
                                   dict(repeat_penalty=0.7, logit_bias={"65": 4.0, 66: -3.5})])
def test_logit_rules_follow_their_definition_in_every_lossless_mode(engines, rules):
    engine = engines[0]
    engine.prepare("hier")
    kw = dict(bias={int(k): v for k, v in rules.get("logit_bias", {}).items()}, presence=rules.get("presence_penalty", 0),
              frequency=rules.get("frequency_penalty", 0), repeat=rules.get("repeat_penalty", 1))
    changed = 0
    for prompt in PROMPTS:
        tokens = engine.tokens_for(prompt, False)
        want = reference_greedy(engine.models.target, tokens, 30, **kw)
        changed += want != run(engine, prompt, "ar", max_tokens=30).tokens
        for mode in ("ar", "sd", "hier", "lookup"):
            assert run(engine, prompt, mode, max_tokens=30, spec=SpecParams(n_draft=4), **rules).tokens == want, \
                (mode, prompt)
    assert changed >= 1  # the rules really changed an answer (the tiny models end most answers early)


def test_logit_rules_are_checked(tiny_engine):
    for kw, name in [(dict(logit_bias={"x": 1}), "logit_bias"), (dict(logit_bias={10 ** 9: 1}), "logit_bias"),
                     (dict(logit_bias={5: 101}), "logit_bias"), (dict(presence_penalty=3), "presence_penalty"),
                     (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(repeat_penalty=0), "repeat_penalty")]:
        with pytest.raises(InvalidParameterError) as err:
            tiny_engine.generate("x", chat_template=False, **kw)
        assert err.value.param == name
