"""The engine: loads a target (and, as modes need them, a drafter and a slim verifier) once,
turns prompts into tokens, runs the decoding loop and turns tokens back into streamed text.

    from via_edge import Engine
    with Engine.from_pair("smollm2", mode="sd") as engine:
        print(engine.generate("Name three primes.", max_tokens=32).text)
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from . import formats
from . import models as catalog
from .batching import BatchedSeq, Scheduler
from .constraints import Constraint, LogitRules, grammar_text
from .decoding import Decoder, SpecParams
from .costs import batch_cost
from .drafters import CopyDrafter, CopyPolicy, Drafter, ModelDrafter, check_compatible
from .errors import ContextOverflowError, InvalidParameterError
from .llama import MAX_SEQ, GrammarState, LlamaModel, LoadParams, common_prefix
from .modes import DEFAULT_MODE, TARGET, Mode, Origin, Tier, check_logprobs, mode_info
from .prompts import chat_tokens
from .sampling import SamplingParams
from .scores import ScoredModel, TokenLogprobs
from .gguf_info import read_info
from .slim import build_f32, build_slim, is_prefix, parse_layers, slice_seq_state, slim_source, target_sha256
from .stats import Stats
from .text import StopMatcher, StreamDecoder
from .tools import Tools, constrain, parse_calls, template_messages
from .tuned import TunedConfig, load_choice


MAX_LOGPROBS = 20  # alternatives per token, as OpenAI allows


@dataclass(frozen=True)
class Piece:
    """A piece of streamed text and the origin of the token that completed it; with logprobs, the
    entries of the tokens since the previous piece."""

    text: str
    token: int
    origin: Origin
    logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass
class Result:
    text: str
    tokens: list[int]
    origins: list[Origin]  # per token: draft, slim or target (which model produced it)
    tiers: list[Tier]      # per token: A, B or C (what decided it; see Stats)
    finish_reason: str     # "stop" (EOS or a stop string), "length", or "cancelled" (should_stop, or
    stats: Stats           # the consumer stopped reading the stream)
    mode: Mode
    prompt_tokens: int
    eog: bool = False      # the last token is the end-of-generation token (part of `tokens`, not of `text`)
    logprobs: list[TokenLogprobs] | None = None  # per answer token (not the EOG), when asked for (Engine.stream)
    tool_calls: list[dict] | None = None  # OpenAI-shaped calls, when Engine.chat was given tools

    @property
    def completion_tokens(self) -> int:
        """The tokens of the answer, without the end-of-generation token (OpenAI's usage count)."""
        return len(self.tokens) - self.eog

    def to_dict(self) -> dict:
        return {"text": self.text, "tokens": self.tokens, "origins": self.origins, "tiers": self.tiers,
                "finish_reason": self.finish_reason, "mode": self.mode,
                "prompt_tokens": self.prompt_tokens, "stats": self.stats.to_dict()}


class Stream:
    """The pieces of one generation as they are committed; `result` once it has ended.

    The result is built in the generator's `finally`, so it is there however the stream ends:
    drained, closed, or read early (reading `result` of a stream still running ends it, with
    finish_reason "cancelled"). The generator holds only the list the result goes into, not the
    stream, so a stream dropped half-read ends (and frees its slot) as soon as it is unreferenced.
    """

    def __init__(self, run: Callable[[list[Result]], Iterator[Piece]], empty: Result) -> None:
        self._box: list[Result] = []
        self._empty = empty  # the result if it is closed before it started
        self._gen = run(self._box)

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Piece:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()
        if not self._box:
            self._box.append(self._empty)

    @property
    def result(self) -> Result:
        if not self._box:
            self.close()
        return self._box[0]

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class _Request:
    """One generation as `stream` checked it."""

    prompt: list[int]
    mode: str
    sp: SamplingParams
    max_tokens: int
    stop: Sequence[str]
    spec: SpecParams
    should_stop: Callable[[], bool] | None
    arrived: float
    grammar: GrammarState | None
    rules: LogitRules | None
    top_logprobs: int | None


@dataclass
class BatchResult:
    """The results of `Engine.generate_batch`, in the order of its prompts, and the batch's wall time."""

    results: list[Result]
    seconds: float

    def __len__(self) -> int:
        return len(self.results)

    def __getitem__(self, i: int) -> Result:
        return self.results[i]

    def __iter__(self) -> Iterator[Result]:
        return iter(self.results)

    @property
    def generated_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.results)

    @property
    def tokens_per_second(self) -> float:
        """Aggregate throughput: every prompt's tokens over the batch's wall time."""
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Slot:
    """One generation's place in the engine: sequence `index` of every model, and the loop's
    views of them (built as modes need them)."""

    index: int
    scored: dict[str, ScoredModel] = field(default_factory=dict)
    drafters: dict[str, Drafter] = field(default_factory=dict)
    holder: object | None = None  # the generation whose turn it is (one-slot engines)
    holder_thread: int | None = None


@dataclass
class _Models:
    target: LlamaModel
    draft: LlamaModel | None = None
    slim: LlamaModel | None = None
    slim_prefix: int | None = None  # blocks kept, when the slim is a prefix of the target
    batch_cost: Callable[[int], float] | None = None  # the target's verification cost by size (lookup)


class Engine:
    """One target plus optional draft and slim, loaded once and reused across calls.

    With `n_parallel` > 1 every model holds that many KV sequences (slots, `n_ctx` split over
    them) and up to that many generations, each in its own thread, advance together in shared
    decodes (batching.py); more wait for a free slot. With 1, calls from other threads wait their
    turn (see `_take_turn`).
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
        pull_missing: bool = False,
        progress: Callable[[str, float], None] | None = None,
        **load_fields,
    ) -> None:
        """`load` and any of its fields given by name (n_ctx, n_threads, kv_type, rpc...) say how
        every model loads; the slots' share of the context is set here from `n_parallel`.
        `rpc=("host:port", ...)` puts a share of the target's layers on those RPC servers
        (`via-edge rpc-serve`), draft and slim stay here."""
        mode_info(mode)
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
        self._scheduler = Scheduler() if n_parallel > 1 else None
        self._slots = [_Slot(i) for i in range(n_parallel)]
        self._free = list(self._slots)
        self._slot_cv = threading.Condition()
        self._load_lock = threading.Lock()  # one thread loads a mode's models
        self._busy = 0
        self._progress = progress
        self._pull = pull_missing
        self._f32 = f32  # run F32 copies of quantized models: see slim.build_f32
        self.target_path = self._model_path(target)
        self.model_name = self.target_path.stem if Path(str(target)).suffix == ".gguf" else str(target)
        n_block = read_info(self.target_path).block_count  # bad layer sets fail before weights load
        for layers in (draft_layers, slim_layers):
            if layers:
                parse_layers(layers, n_block)
        self._draft_spec, self._draft_layers = draft, draft_layers
        self._slim_spec, self._slim_layers = slim, slim_layers
        self._slim_kv = slim_kv
        self.models = _Models(self._load("target", self.target_path))
        self.tuned: TunedConfig | None = None  # set by from_pair when a tuned choice applied
        self.prepare(mode)

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pair(cls, name: str | None = None, *, tuned: bool = True, overrides: Mapping | None = None,
                  fallback_mode: str = DEFAULT_MODE, **kwargs) -> "Engine":
        """An engine for a catalog pair (default: the catalog's default pair).

        When `via-edge tune` has tuned the pair on this machine (and `tuned` is true), its choice
        supplies the weight formats of target and draft, the mode, the slim layers and each mode's knobs. Keywords given here win;
        `overrides` (SpecParams fields) change single knobs of every mode's tuned spec, while an
        explicit `spec` replaces them all. Without a tuned choice the mode is `fallback_mode`.
        """
        pair = catalog.pair(name)
        choice = load_choice(pair["name"]) if tuned else None
        over = dict(overrides or {})
        if choice is not None:
            kwargs.setdefault("mode", choice.mode)
            if choice.slim_layers:
                kwargs.setdefault("slim_layers", choice.slim_layers)
            if "spec" not in kwargs:
                mode = kwargs["mode"] if kwargs["mode"] in choice.modes else None
                kwargs["spec"] = replace(choice.spec(mode), **over)
                kwargs.setdefault("mode_specs", {m: replace(choice.spec(m), **over) for m in choice.modes})
        elif over and "spec" not in kwargs:
            kwargs["spec"] = SpecParams(**over)
        kwargs.setdefault("mode", fallback_mode)
        kwargs.setdefault("draft_layers", pair.get("draft_layers"))
        kwargs.setdefault("slim_layers", pair.get("slim_layers"))
        target, draft = pair["target"], pair.get("draft")
        if choice is not None and not kwargs.get("f32"):  # the tuned weight formats (derived once, then reused)
            pull = kwargs.get("pull_missing", False)
            target = formats.derive(catalog.resolve(target, pull_missing=pull), choice.target_format)
            if draft:
                draft = formats.derive(catalog.resolve(draft, pull_missing=pull), choice.draft_format)
        engine = cls(target, draft, **kwargs)
        engine.model_name = pair["target"]  # the catalog's name, whichever format runs
        engine.tuned = choice
        return engine

    @property
    def weight_format(self) -> str:
        """The target's format: a derived recipe (formats.py) or the file's own quantization."""
        return formats.describe(self.target_path)

    def _model_path(self, spec: str | Path) -> Path:
        path = catalog.resolve(spec, pull_missing=self._pull)
        return build_f32(path) if self._f32 else path

    def _load(self, role: str, path: Path) -> LlamaModel:
        cb = None
        if self._progress is not None:
            cb = lambda frac, role=role: self._progress(role, frac)  # noqa: E731
        # only the target's layers go to RPC servers: draft and slim run here, where they are cheap
        params = self.load if role == "target" else replace(self.load, rpc=(), tensor_split=())
        return LlamaModel(path, params, progress=cb)

    def prepare(self, mode: str) -> None:
        """Load whatever `mode` needs that is not loaded yet."""
        with self._load_lock:
            self._prepare(mode)

    def _prepare(self, mode: str) -> None:
        info, m = mode_info(mode), self.models
        if info.draft_model and m.draft is None:
            m.draft = self._load_derived("draft", self._draft_spec, self._draft_layers, mode)
        if info.slim and m.slim is None:
            m.slim = self._load_derived("slim", self._slim_spec, self._slim_layers, mode)
            source = slim_source(m.slim.path)  # KV import only from the very target the slim was cut from
            if source and is_prefix(source[0]) and source[1] == target_sha256(self.target_path):
                m.slim_prefix = len(source[0])
        # with slots, measured at start-up whatever the mode: later, it would decode beside (and
        # reset the caches of) running generations
        if (info.drafter == "lookup" or self._scheduler is not None) and m.batch_cost is None:
            if self._progress is not None:
                self._progress("batch costs", 0.0)
            m.batch_cost = batch_cost(m.target)  # measured once per machine and model file
            if self._progress is not None:
                self._progress("batch costs", 1.0)

    def _load_derived(self, role: str, given: str | Path | None, layers: str | None, mode: str) -> LlamaModel:
        """The draft or slim: a given file, else a slim of the target's `layers`; checked against it."""
        if given is not None:
            path = self._model_path(given)
        elif layers:
            path = build_slim(self.target_path, layers)
        else:
            raise InvalidParameterError(f"mode {mode} needs a {role} model (or {role}_layers)")
        model = self._load(role, path)
        check_compatible(self.models.target, model, role)
        return model

    def _drafter(self, slot: _Slot, mode: str) -> Drafter | None:
        kind = mode_info(mode).drafter
        if kind is not None and kind not in slot.drafters:
            slot.drafters[kind] = (CopyDrafter(CopyPolicy(self.models.batch_cost), others=self._others)
                                   if kind == "lookup" else ModelDrafter(self._scorer(slot, "draft")))
        return slot.drafters.get(kind) if kind else None

    def _others(self) -> int:
        """Tokens the other slots add to the target's next decode (none without slots)."""
        return self._scheduler.others(self.models.target) if self._scheduler is not None else 0

    def _scorer(self, slot: _Slot, role: str) -> ScoredModel | None:
        """The decoding loop's view of a slot's sequence of a loaded model (kept, so its EOG
        lookups are cached): direct with one slot, through the scheduler with several."""
        model = getattr(self.models, role)
        if model is None:
            return None
        if role not in slot.scored or slot.scored[role].model is not model:
            seq = model.seqs[slot.index]
            slot.scored[role] = ScoredModel(model, seq if self._scheduler is None else
                                            BatchedSeq(seq, self._scheduler))
        return slot.scored[role]

    # ---- slots ----------------------------------------------------------------------------------
    def _acquire(self, prompt: Sequence[int], me: object) -> _Slot:
        """A slot for generation `me`, waiting for one: the free one whose cache shares most of
        `prompt` (a chat's next turn finds its own history)."""
        with self._slot_cv:
            self._busy += 1
            if self._scheduler is None:
                slot = self._slots[0]
                self._take_turn(slot, me)
                return slot
            while not self._free:
                self._slot_cv.wait()
            # ties to the lowest id (with the unified KV buffer the ids' order costs nothing)
            slot = max(self._free, key=lambda s: (common_prefix(self.target.seqs[s.index].tokens, prompt), -s.index))
            self._free.remove(slot)
        self._scheduler.enter()
        return slot

    def _take_turn(self, slot: _Slot, me: object) -> None:
        """With one slot, generations take turns: `me` waits while another thread's generation
        holds it. A generation of this same thread holds it only while suspended (a stream left
        half-read), so `me` takes it over rather than wait forever; the other re-syncs the KV
        cache when it is read again. Called holding `_slot_cv`."""
        thread = threading.get_ident()
        while slot.holder not in (None, me) and slot.holder_thread != thread:
            self._slot_cv.wait()
        slot.holder, slot.holder_thread = me, thread

    def _release(self, slot: _Slot, me: object) -> None:
        if self._scheduler is not None:
            self._scheduler.leave()
        with self._slot_cv:
            self._busy -= 1
            if self._scheduler is not None:
                self._free.append(slot)
                self._slot_cv.notify()
            elif slot.holder is me:
                slot.holder = slot.holder_thread = None
                self._slot_cv.notify_all()

    @property
    def slots_busy(self) -> int:
        """Generations under way (with several slots, at most n_parallel)."""
        return self._busy

    # ---- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        for m in (self.models.slim, self.models.draft, self.models.target):
            if m is not None:
                m.close()

    def reset(self) -> None:
        """Forget every cached prompt (KV caches), so the next call pays its full prefill, and
        what the copy drafters learned."""
        for m in (self.models.slim, self.models.draft, self.models.target):
            if m is not None:
                m.reset()
        for slot in self._slots:
            slot.drafters.pop("lookup", None)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- prompts --------------------------------------------------------------------------------
    @property
    def target(self) -> LlamaModel:
        return self.models.target

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], tools: Tools | None = None) -> list[int]:
        """The prompt tokens of a conversation; with `tools` (tools.Tools), the functions too, and
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

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], **kwargs) -> Result:
        """Generate to completion; see `stream` for the parameters."""
        return _drain(self.stream(prompt, **kwargs))

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], **kwargs) -> BatchResult:
        """Generate for every prompt, up to `n_parallel` at a time in shared decodes; one result
        per prompt, in order. Keywords as for `stream`, the same for every prompt. Every prompt
        is checked before any runs."""
        t0 = time.perf_counter()
        streams = [self.stream(p, arrived=t0, **kwargs) for p in prompts]
        with ThreadPoolExecutor(max_workers=self.n_parallel, thread_name_prefix="via-edge-slot") as pool:
            results = list(pool.map(_drain, streams))
        return BatchResult(results, time.perf_counter() - t0)

    def chat(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
             tool_choice: Any = None, **kwargs) -> Result:
        """A conversation's answer; with OpenAI-style `tools`, its calls are in `tool_calls`
        (tool_choice "required" or a named function makes the answer one call)."""
        spec = Tools.parse(tools, tool_choice)
        res = self.generate(self.chat_prompt(messages, spec), **constrain(spec, kwargs))
        if spec is not None:
            res.tool_calls = parse_calls(res.text)[1]
        return res

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 256,
        stop: Sequence[str] = (),
        mode: str | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        chat_template: bool = True,
        spec: SpecParams | None = None,
        should_stop: Callable[[], bool] | None = None,
        arrived: float | None = None,
        grammar: str | None = None,
        response_format: Mapping[str, Any] | None = None,
        logprobs: int | None = None,
        logit_bias: Mapping[Any, float] | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repeat_penalty: float = 1.0,
    ) -> Stream:
        """Text pieces as tokens are committed; the stream's `result` carries text, tokens and stats.

        A str prompt gets the model's chat template unless `chat_template=False`; a token list is
        used as is. `temperature=0` is greedy. `should_stop` is polled after every token (a
        server's disconnected client, say); when it returns True the result ends as "cancelled".
        The generation takes a slot when the stream is first read; the time from `arrived` (a
        `time.perf_counter()` value, default: now) until then is the stats' `queue_seconds`.
        `grammar` (GBNF) or `response_format` (OpenAI's: JSON, or JSON matching a schema)
        constrains every mode's output; `logit_bias` (token id -> -100..100) and the penalties change
        the logits of target and drafts alike (constraints.py). `logprobs=n` (0..20) gives the
        result the target's log-probability of each token and its n likeliest alternatives.
        """
        arrived = time.perf_counter() if arrived is None else arrived
        mode = mode or self.mode
        mode_info(mode)
        if max_tokens < 1:
            raise InvalidParameterError(f"max_tokens must be >= 1, got {max_tokens}")
        sp = SamplingParams(temperature, top_k, top_p, min_p, seed)
        self.prepare(mode)
        tokens = self.tokens_for(prompt, chat_template)
        if not tokens:
            raise InvalidParameterError("the prompt is empty")
        self.check_fits(tokens)
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise InvalidParameterError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {logprobs}", "logprobs")
        check_logprobs(mode, logprobs)
        gbnf = grammar_text(grammar, response_format)
        rules = LogitRules.make(self.target.n_vocab, logit_bias, presence_penalty, frequency_penalty, repeat_penalty)
        req = _Request(tokens, mode, sp, max_tokens, stop, spec or self.mode_specs.get(mode) or self.spec,
                       should_stop, arrived, self.target.grammar(gbnf) if gbnf else None, rules, logprobs)
        empty = Result("", [], [], [], "cancelled", Stats(prompt_tokens=len(tokens)), mode, len(tokens))
        return Stream(lambda box: self._run(box, req), empty)

    def _run(self, box: list[Result], req: _Request) -> Iterator[Piece]:
        me = object()
        slot = self._acquire(req.prompt, me)
        steps = self._generate(box, slot, req, time.perf_counter() - req.arrived)
        try:
            while True:
                if self._scheduler is None:
                    with self._slot_cv:  # the turn may have passed to a newer call of this thread
                        self._take_turn(slot, me)
                piece = next(steps, None)
                if piece is None:
                    return
                yield piece
        finally:
            steps.close()
            self._release(slot, me)

    def _generate(self, box: list[Result], slot: _Slot, req: _Request, queued: float) -> Iterator[Piece]:
        prompt, mode, stop, should_stop = req.prompt, req.mode, req.stop, req.should_stop
        info = mode_info(mode)
        stats = Stats(prompt_tokens=len(prompt), queue_seconds=queued)
        roles = ["target"] + ["draft"] * info.draft_model + ["slim"] * info.slim
        used = [(role, self._scorer(slot, role)) for role in roles]
        before = {role: replace(scored.seq.usage) for role, scored in used}  # this slot's share only
        target = self._scorer(slot, "target")
        out_tokens: list[int] = []
        origins: list[Origin] = []
        tiers: list[Tier] = []
        pieces: list[str] = []
        finish = "cancelled"  # unless the loop below says otherwise: the consumer stopped reading
        eog = False
        lps: list[TokenLogprobs] | None = [] if req.top_logprobs is not None else None
        sent = 0  # logprobs entries already in a piece
        t0 = t1 = time.perf_counter()
        try:
            stats.cache_tokens = common_prefix(target.tokens, prompt[:-1])
            self._prefill(slot, prompt[:-1], used)
            t1 = time.perf_counter()
            stats.prefill_seconds = t1 - t0
            decoder = Decoder(target, self._drafter(slot, mode), self._scorer(slot, "slim"), req.spec,
                              Constraint(req.grammar, req.rules) if req.grammar or req.rules else None,
                              req.top_logprobs)
            text_out = StreamDecoder()
            stops = StopMatcher(stop)
            stopped_by_string = False
            gen = decoder.generate(prompt, mode, req.sp, req.max_tokens, stats)
            try:
                finish = "length"
                for tok, origin, tier in gen:
                    out_tokens.append(tok)
                    origins.append(origin)
                    tiers.append(tier)
                    if target.is_eog(tok):
                        finish, eog = "stop", True
                        break
                    if lps is not None:
                        lps.append(decoder.logprobs[len(prompt) + len(out_tokens) - 1])
                    text, stopped_by_string = stops.feed(text_out.feed(self.target.token_bytes(tok)))
                    if text:
                        pieces.append(text)
                        finish = "cancelled"  # if the consumer stops reading at this piece
                        yield Piece(text, tok, origin, tuple(lps[sent:]) if lps else ())
                        sent = len(lps) if lps else 0
                        finish = "length"
                    if stopped_by_string:
                        finish = "stop"
                        break
                    if should_stop is not None and should_stop():
                        finish = "cancelled"
                        break
            finally:
                gen.close()
            if not stopped_by_string:  # release bytes and text held back for a match that never came
                tail, hit = stops.feed(text_out.flush())
                tail += "" if hit else stops.flush()
                if tail:
                    pieces.append(tail)
                    kept, finish = finish, "cancelled"
                    yield Piece(tail, out_tokens[-1] if out_tokens else -1, origins[-1] if origins else TARGET,
                                tuple(lps[sent:]) if lps else ())
                    finish = kept
        finally:
            stats.generate_seconds = time.perf_counter() - t1
            for role, scored in used:
                setattr(stats, role, scored.seq.usage.since(before[role]))
            box.append(Result("".join(pieces), out_tokens, origins, tiers, finish, stats, mode, len(prompt), eog,
                              lps))

    def _prefill(self, slot: _Slot, tokens: list[int], used: list[tuple[str, ScoredModel]]) -> None:
        """Fill every model's KV with the prompt (all but its last token, which each round decodes).

        A prefix slim imports the target's KV instead of recomputing it (see docs/design.md).
        """
        m = self.models
        for role, scored in used:
            seq = scored.model.seqs[slot.index]
            if not tokens:
                seq.reset()
            elif role == "slim" and m.slim_prefix and self._slim_kv == "import":
                if seq.tokens[:len(tokens)] != tokens:
                    source = m.target.seqs[slot.index]
                    seq.set_state(slice_seq_state(source.state(), m.slim_prefix), source.tokens)
            else:
                scored.seq.prefill(tokens)


def _drain(stream: Stream) -> Result:
    for _ in stream:
        pass
    return stream.result
