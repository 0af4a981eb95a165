"""The engine: loads a target (and, as modes need them, a drafter and a slim verifier) once,
turns prompts into checked requests, runs the decoding loop on a slot and turns tokens back into
streamed text.

    from via_edge import Engine
    with Engine.from_pair("smollm2", mode="sd") as engine:
        print(engine.generate("Name three primes.", max_tokens=32).text)

`request` checks everything a generation asks for (and compiles its grammar) without running
anything; `run` runs a request. A server builds the request before it queues, so a bad one is
refused at once and a queued one cannot fail its checks later.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from .decode.constraints import Constraint, LogitRules, grammar_text
from .decode.loop import Decoder
from .decode.memory import DEFAULT_TOKENS, CopyMemory
from .decode.modes import DEFAULT_MODE, TARGET, check_logprobs, mode_info
from .decode.sampling import SamplingParams
from .decode.scores import TokenLogprobs
from .decode.sources import CopySource
from .decode.spec import SpecParams
from .decode.stats import Stats
from .decode.text import StopMatcher, StreamDecoder
from .errors import ContextOverflowError, InvalidParameterError
from .llama import MAX_SEQ, GrammarState, LlamaModel, LoadParams, common_prefix
from .loading import Loader, Models, model_file, pair_arguments
from .prediction import prediction_source, settle
from .openai_api.callparse import parse_calls
from .openai_api.toolcalls import Tools, constrain, template_messages
from .prompts import chat_tokens
from .results import BatchResult, Piece, Result, Stream, drain
from .slots import Slot, SlotPool
from .tune.store import TunedConfig
from .weights import formats
from .weights.gguf_info import read_info
from .weights.slim import parse_layers

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI allows


@dataclass(frozen=True)
class Request:
    """One generation, every value checked and its grammar compiled (`Engine.request`); run it
    with `Engine.run`, as often as wanted (each run gets its own grammar state)."""

    prompt: tuple[int, ...]
    mode: str
    sampling: SamplingParams
    max_tokens: int
    stop: tuple[str, ...]
    spec: SpecParams
    grammar: GrammarState | None = None
    rules: LogitRules | None = None
    top_logprobs: int | None = None
    prediction: CopySource | None = None  # OpenAI's Predicted Outputs: a copy source, never shown to the model


class Engine:
    """One target plus optional draft and slim, loaded once and reused across calls.

    With `n_parallel` > 1 every model holds that many KV sequences (slots, `n_ctx` split over
    them) and up to that many generations, each in its own thread, advance together in shared
    decodes (batching.py); more wait for a free slot. With 1, calls from other threads wait their
    turn (slots.py).
    """

    def __init__(
        self,
        target: str | Path,
        draft: str | Path | None = None,
        slim: str | Path | None = None,
        *,
        mode: str = DEFAULT_MODE,
        draft_layers: str | None = None,
        slim_layers: str | None = None,
        n_parallel: int = 1,
        load: LoadParams = LoadParams(),
        spec: SpecParams = SpecParams(),
        mode_specs: Mapping[str, SpecParams] | None = None,
        slim_kv: str = "import",
        f32: bool = False,
        format: str | None = None,
        copy_memory: int = DEFAULT_TOKENS,
        pull_missing: bool = False,
        progress: Callable[[str, float], None] | None = None,
        **load_fields,
    ) -> None:
        """`load` and any of its fields given by name (n_ctx, n_threads, kv_type, rpc...) say how
        every model loads; the slots' share of the context is set here from `n_parallel`.
        `rpc=("host:port", ...)` puts a share of the target's layers on those RPC servers
        (`via-edge rpc-serve`), draft and slim stay here. `format` is the weight format: `auto`
        (the default for a catalog name: weights/autoformat.py), `shipped` (the file as it is, the
        default for a path) or a recipe name (weights/formats.py); VIA_EDGE_FORMAT sets the default.
        `copy_memory` is how many tokens of recent answers and predictions copy drafting may read
        from in later requests (decode/memory.py; 0: off)."""
        mode_info(mode)
        self.memory = CopyMemory(copy_memory)
        if not 1 <= n_parallel <= MAX_SEQ:
            raise InvalidParameterError(f"n_parallel must be in 1..{MAX_SEQ}, got {n_parallel}")
        if slim_kv not in ("import", "prefill"):
            raise InvalidParameterError("slim_kv must be 'import' or 'prefill'")
        self.mode = mode
        self.spec = spec
        self.mode_specs = dict(mode_specs or {})  # per-mode knobs (a tuned configuration) over `spec`
        unknown = set(load_fields) - ({f.name for f in fields(LoadParams)} - {"n_seq", "kv_unified"})
        if unknown:  # the slots' fields come from n_parallel
            raise TypeError(f"Engine() got unexpected keyword arguments: {', '.join(sorted(unknown))}")
        load_fields = {k: tuple(v) if k in ("rpc", "tensor_split", "capture") else v for k, v in load_fields.items()}
        self.load = replace(load, **load_fields, n_seq=n_parallel, kv_unified=n_parallel > 1)
        self.n_parallel = n_parallel
        self._slim_kv = slim_kv
        self.target_path = model_file(target, pull_missing, f32, format, self.load)
        self.model_name = self.target_path.stem if Path(str(target)).suffix == ".gguf" else str(target)
        n_block = read_info(self.target_path).block_count  # bad layer sets fail before weights load
        for layers in (draft_layers, slim_layers):
            if layers:
                parse_layers(layers, n_block)
        self._loader = Loader(self.target_path, draft, slim, draft_layers, slim_layers, self.load, f32=f32,
                              pull_missing=pull_missing, progress=progress, format=format)
        self.models: Models = self._loader.models
        self.slots = SlotPool(n_parallel, self.models)
        self.tuned: TunedConfig | None = None  # set by from_pair when a tuned choice applied
        self.prepare(mode)

    @classmethod
    def from_pair(cls, name: str | None = None, *, tuned: bool = True, overrides: Mapping | None = None,
                  fallback_mode: str = DEFAULT_MODE, **kwargs) -> "Engine":
        """An engine for a catalog pair (default: the catalog's default pair), in the formats,
        mode and knobs `via-edge tune` chose on this machine when `tuned` (loading.pair_arguments);
        without a tuned choice the mode is `fallback_mode`."""
        name, target, draft, choice, kwargs = pair_arguments(name, tuned, dict(overrides or {}), fallback_mode,
                                                             **kwargs)
        engine = cls(target, draft, **kwargs)
        engine.model_name = name  # the catalog's name, whichever format runs
        engine.tuned = choice
        return engine

    @property
    def format(self) -> str:
        """The target's weight format as `--format` names it: a derived recipe, or `shipped`."""
        found = formats.variant_source(self.target_path)
        return found[0] if found else formats.SHIPPED

    @property
    def weight_format(self) -> str:
        """The target's format: a derived recipe (weights/formats.py) or the file's own quantization."""
        return formats.format_name(self.target_path)

    @property
    def target(self) -> LlamaModel:
        return self.models.target

    def prepare(self, mode: str) -> None:
        """Load whatever `mode` needs that is not loaded yet."""
        self._loader.prepare(mode, batched=self.slots.scheduler is not None)

    @property
    def slots_busy(self) -> int:
        """Generations under way (with several slots, at most n_parallel)."""
        return self.slots.busy

    # ---- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        self.slots.close()
        for m in self.models.each():
            m.close()

    def reset(self, memory: bool = True) -> None:
        """Forget every cached prompt (KV caches), so the next call pays its full prefill, what
        the copy drafters indexed and, unless `memory` is False, the copy memory."""
        for m in self.models.each():
            m.reset()
        self.slots.forget_copies()
        if memory:
            self.memory.clear()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- prompts --------------------------------------------------------------------------------
    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], tools: Tools | None = None) -> list[int]:
        """The prompt tokens of a conversation; with `tools` (toolcalls.Tools), the functions too, and
        earlier calls and results however the model's template takes them."""
        msgs, offered = template_messages(messages, tools, self.target.chat_template)
        return chat_tokens(self.target, msgs, offered)

    def check_fits(self, tokens: Sequence[int]) -> None:
        """A prompt must leave one slot's context room for at least one new token."""
        if len(tokens) >= self.target.n_ctx:
            per = f" per slot ({self.n_parallel} slots)" if self.n_parallel > 1 else ""
            raise ContextOverflowError(f"the prompt has {len(tokens)} tokens but the context window holds "
                                       f"{self.target.n_ctx}{per}; shorten it or raise n_ctx (--ctx)")

    def tokens_for(self, prompt: str | Sequence[int], chat_template: bool) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if chat_template:
            return self.chat_prompt([{"role": "user", "content": prompt}])
        return self.target.tokenize(prompt, add_special=True, parse_special=False)

    # ---- requests -------------------------------------------------------------------------------
    def request(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 256,
        stop: str | Sequence[str] = (),
        mode: str | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        chat_template: bool = True,
        spec: SpecParams | None = None,
        grammar: str | None = None,
        response_format: Mapping[str, Any] | None = None,
        logprobs: int | None = None,
        logit_bias: Mapping[Any, float] | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repeat_penalty: float = 1.0,
        prediction: str | Sequence[int] | None = None,
    ) -> Request:
        """A checked generation (InvalidParameterError or ContextOverflowError naming what is
        wrong); nothing is loaded or run.

        A str prompt gets the model's chat template unless `chat_template=False`; a token list is
        used as is. `temperature=0` is greedy. `grammar` (GBNF) or `response_format` (OpenAI's:
        JSON, or JSON matching a schema) constrains every mode's output; `logit_bias` (token id ->
        -100..100) and the penalties change the logits of target and drafts alike (decode/constraints.py).
        `logprobs=n` (0..20) gives the result the target's log-probability of each token and its n
        likeliest alternatives. `prediction` (text or tokens: what the answer will likely repeat,
        such as the file an edit rewrites) is drafted from in every mode, never shown to the
        model: the answer is the one the request gets without it.
        """
        mode = mode or self.mode
        mode_info(mode)
        if max_tokens < 1:
            raise InvalidParameterError(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        sp = SamplingParams(temperature, top_k, top_p, min_p, seed)
        tokens = self.tokens_for(prompt, chat_template)
        if not tokens:
            raise InvalidParameterError("the prompt is empty", "prompt")
        self.check_fits(tokens)
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise InvalidParameterError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {logprobs}", "logprobs")
        check_logprobs(mode, logprobs)
        gbnf = grammar_text(grammar, response_format)
        rules = LogitRules.make(self.target.n_vocab, logit_bias, presence_penalty, frequency_penalty, repeat_penalty)
        try:
            compiled = self.target.grammar(gbnf) if gbnf else None
        except InvalidParameterError as exc:  # it does not parse: name the field it came from
            raise InvalidParameterError(str(exc), "grammar" if grammar is not None else "response_format") from None
        return Request(tuple(tokens), mode, sp, max_tokens, (stop,) if isinstance(stop, str) else tuple(stop),
                       spec or self.mode_specs.get(mode) or self.spec, compiled, rules, logprobs,
                       prediction_source(self.target, prediction))

    def run(self, request: Request, *, should_stop: Callable[[], bool] | None = None,
            arrived: float | None = None) -> Stream:
        """Text pieces as tokens are committed; the stream's `result` carries text, tokens and stats.

        The generation takes a slot when the stream is first read; the time from `arrived` (a
        `time.perf_counter()` value, default: now) until then is the stats' `queue_seconds`.
        `should_stop` is polled after every token (a server's disconnected client, say); when it
        returns True the result ends as "cancelled".
        """
        arrived = time.perf_counter() if arrived is None else arrived
        self.prepare(self._run_mode(request))
        # a list, as the caches hold theirs: common_prefix compares list slices at C speed, and a
        # tuple against a list is never equal, which would walk every token in Python
        prompt = list(request.prompt)
        empty = Result("", [], [], [], "cancelled", Stats(prompt_tokens=len(prompt)), request.mode, len(prompt))
        return Stream(lambda box: self.slots.occupy(
            prompt, lambda slot: self._generate(box, slot, request, prompt, should_stop, arrived)), empty)

    def stream(self, prompt: str | Sequence[int], *, should_stop: Callable[[], bool] | None = None,
               arrived: float | None = None, **options) -> Stream:
        """`run(request(prompt, **options))`: see those two for the parameters."""
        return self.run(self.request(prompt, **options), should_stop=should_stop, arrived=arrived)

    def generate(self, prompt: str | Sequence[int], **kwargs) -> Result:
        """Generate to completion; see `stream` for the parameters."""
        return drain(self.stream(prompt, **kwargs))

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], **kwargs) -> BatchResult:
        """Generate for every prompt, up to `n_parallel` at a time in shared decodes; one result
        per prompt, in order. Keywords as for `stream`, the same for every prompt. Every prompt
        is checked before any runs."""
        t0 = time.perf_counter()
        streams = [self.stream(p, arrived=t0, **kwargs) for p in prompts]
        with ThreadPoolExecutor(max_workers=self.n_parallel, thread_name_prefix="via-edge-slot") as pool:
            results = list(pool.map(drain, streams))
        return BatchResult(results, time.perf_counter() - t0)

    def chat(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
             tool_choice: Any = None, **kwargs) -> Result:
        """A conversation's answer; with OpenAI-style `tools`, its calls are in `tool_calls`
        (tool_choice "required" or a named function makes the answer one call)."""
        spec = Tools.parse(tools, tool_choice)
        res = self.generate(self.chat_prompt(messages, spec), **constrain(spec, kwargs))
        if spec is not None:
            res.tool_calls = parse_calls(res.text, spec.names)[1]
            if res.tool_calls and res.finish_reason == "stop":
                res.finish_reason = "tool_calls"  # as OpenAI ends an answer that calls
        return res

    # ---- one generation -------------------------------------------------------------------------
    @staticmethod
    def _run_mode(req: Request) -> str:
        """The mode the loop runs: a prediction turns on copy drafting in `ar`."""
        return "lookup" if req.prediction is not None and mode_info(req.mode).drafter is None else req.mode

    def _generate(self, box: list[Result], slot: Slot, req: Request, prompt: list[int],
                  should_stop: Callable[[], bool] | None, arrived: float) -> Iterator[Piece]:
        """Tokens to text on `slot`: stop strings, UTF-8 held back until whole, the finish reason.
        A consumer that stops reading (GeneratorExit) ends it as "cancelled"."""
        info = mode_info(req.mode)
        stats = Stats(prompt_tokens=len(prompt), queue_seconds=time.perf_counter() - arrived)
        roles = ["target"] + ["draft"] * info.draft_model + ["slim"] * info.slim
        used = [(role, self.slots.scorer(slot, role)) for role in roles]
        before = {role: replace(scored.seq.usage) for role, scored in used}  # this slot's share only
        target = used[0][1]
        out: list[int] = []
        origins, tiers, pieces = [], [], []
        lps: list[TokenLogprobs] | None = [] if req.top_logprobs is not None else None
        sent = 0  # logprobs entries already in a piece
        finish, eog = "length", False
        t0 = t1 = time.perf_counter()
        try:
            stats.cache_tokens = common_prefix(target.tokens, prompt[:-1])
            primed = self.slots.prefill(slot, prompt, used, import_slim=self._slim_kv == "import")
            stats.first_from_prompt = int(primed)
            t1 = time.perf_counter()
            stats.prefill_seconds = t1 - t0
            stats.prefilled_tokens = target.seq.usage.tokens - before["target"].tokens
            grammar = req.grammar.clone() if req.grammar is not None else None
            pred = req.prediction
            sources = ([pred] if pred is not None else []) + self.memory.sources()
            decoder = Decoder(target, self.slots.drafter(slot, req.mode, copy=pred is not None),
                              self.slots.scorer(slot, "slim"), req.spec,
                              Constraint(grammar, req.rules) if grammar or req.rules else None, req.top_logprobs,
                              sources)
            text_out, stops = StreamDecoder(), StopMatcher(req.stop)
            hit = False
            gen = decoder.generate(prompt, self._run_mode(req), req.sampling, req.max_tokens, stats)
            try:
                for c in gen:
                    out.append(c.token)
                    origins.append(c.origin)
                    tiers.append(c.tier)
                    if target.is_eog(c.token):
                        finish, eog = "stop", True
                        break
                    if lps is not None:
                        lps.append(c.logprob)
                    text, hit = stops.feed(text_out.feed(self.target.token_bytes(c.token)))
                    if text:
                        pieces.append(text)
                        yield Piece(text, c.token, c.origin, tuple(lps[sent:]) if lps else ())
                        sent = len(lps) if lps else 0
                    if hit:
                        finish = "stop"
                        break
                    if should_stop is not None and should_stop():
                        finish = "cancelled"
                        break
            finally:
                gen.close()
            if not hit:  # release bytes and text held back for a match that never came
                tail, tail_hit = stops.feed(text_out.flush())
                tail += "" if tail_hit else stops.flush()
                if tail:
                    pieces.append(tail)
                    yield Piece(tail, out[-1] if out else -1, origins[-1] if origins else TARGET,
                                tuple(lps[sent:]) if lps else ())
        except BaseException:  # the consumer stopped reading (GeneratorExit), or a decode failed
            finish = "cancelled"
            raise
        finally:
            stats.generate_seconds = time.perf_counter() - t1
            for role, scored in used:
                setattr(stats, role, scored.seq.usage.since(before[role]))
            settle(stats, req.prediction, prompt, out[:-1] if eog else out, self.memory)
            box.append(Result("".join(pieces), out, origins, tiers, finish, stats, req.mode, len(prompt), eog, lps))
