"""`via-edge bench`: every method on every prompt, interleaved, models loaded once.

Each prompt runs all methods back to back, so machine noise hits them alike, in an order that
changes per prompt and round (`metrics.run_orders`: every method as often in each place, and
right after each other method as often); every model's KV cache is cleared before each run, so
each run pays its own prefill; a warm-up prompt runs every method first and is not counted.
Speedups are ratios to `ar` on the same prompt in the same run. With `rounds` > 1 each prompt runs
every method that many times, in the next order each round (with two methods each goes first
once), and a ratio pairs the runs of one round: repeats where a shared machine's noise is larger
than the effect measured.
Task accuracy (a suite with unit tests) is judged on the first round's answers.

Each method keeps a copy memory of its own (decode/memory.py) across the run, as a server keeps
its requests' answers: a method never drafts from another method's answer to the same prompt,
nor from its own in an earlier round (each round starts from the memory the prompt found).
Variants of a mode: `<mode>:predicted` sends a row's `prediction` (the file an edit rewrites, as
editors send it), `<mode>:nomemory` runs without the copy memory. A row's `earlier` requests (an
agent's sequence) run untimed before it on the same method, peers included.
"""

from __future__ import annotations

import datetime as _dt
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..decode.memory import DEFAULT_TOKENS, CopyMemory
from ..decode.modes import MODE_NAMES
from ..decode.spec import SpecParams
from ..engine import Engine
from ..errors import InvalidParameterError
from ..llama import EXACT, EXACT_F32, LoadParams, default_threads
from ..machine import machine, versions
from ..progress import StatusLine
from ..tune.store import load_choice
from ..weights import catalog
from ..weights.autoformat import AUTO, check_name, requested
from ..weights.slim import target_sha256
from .metrics import in_run_order
from .peers import DEFAULT_PEERS, PEERS, make_peer
from .report import summarize
from .suite import Prompt, load_prompts
from .tasks import passes

WARMUP = "Say hello in one short sentence."
VARIANTS = ("predicted", "nomemory")  # what `--modes` may add to a mode after ":"
QUICK = dict(pair="smollm2", per_category=1, max_tokens=32,
             categories=["coding", "extraction", "translation", "math_reasoning"])


@dataclass
class BenchConfig:
    pair: str | None = None
    modes: list[str] = field(default_factory=lambda: ["ar", "sd", "via", "hier", "lookup"])
    peers: list[str] = field(default_factory=lambda: list(DEFAULT_PEERS))  # peers to run beside (bench.peers)
    peer_python: str | None = None  # run them with this Python (another environment's build)
    suite: str = "spec-bench"
    categories: list[str] | None = None
    per_category: int = 1
    max_tokens: int = 128
    exact: bool = False
    n_ctx: int = 4096
    threads: int | None = None
    spec: SpecParams = field(default_factory=SpecParams)
    tuned: bool = False  # also every mode with the pair's tuned knobs and slim, as "<mode>:tuned"
    response_format: dict | None = None  # also every mode constrained to it, as "<mode>:json"
    remote: dict = field(default_factory=dict)  # LoadParams' rpc and tensor_split: the target over RPC servers
    format: str | None = None  # the target's weight format (Engine's `format`; default auto)
    f32: bool = False
    quick: bool = False
    copy_memory: int = DEFAULT_TOKENS  # each method's copy memory, in tokens (":nomemory": none)
    rounds: int = 1  # runs of every method on every prompt, paired by round
    command: str = ""

    def validate(self) -> None:
        unknown = [p for p in self.peers if p.partition("@")[0] not in PEERS]
        if unknown:
            raise InvalidParameterError(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(PEERS)}")
        if self.peer_python and not Path(self.peer_python).exists():
            raise InvalidParameterError(f"--peer-python {self.peer_python} does not exist")
        for m in self.modes + self.peers:
            if "@" in m:
                check_name(m.partition("@")[2], f"the format of {m}")
        if self.format is not None:
            requested(self.format, explicit_path=False)
        bad = [m for m in self.modes if m.partition(":")[0].partition("@")[0] not in MODE_NAMES]
        if bad:
            raise InvalidParameterError(f"unknown mode(s) {', '.join(bad)}; choose from {', '.join(MODE_NAMES)}")
        odd = [m for m in self.modes if ":" in m and m.partition(":")[2] not in VARIANTS]
        if odd:
            raise InvalidParameterError(f"unknown variant(s) {', '.join(odd)}; a mode may end in "
                                        f"{' or '.join(':' + v for v in VARIANTS)}")
        if "ar" not in self.modes:
            raise InvalidParameterError("--modes must include ar: every speed is a ratio to it")
        if len(set(self.modes)) != len(self.modes):
            raise InvalidParameterError("--modes lists a mode twice")
        if self.max_tokens < 1:
            raise InvalidParameterError("--max-tokens must be at least 1")
        if not 1 <= self.rounds <= 100:
            raise InvalidParameterError(f"--rounds must be 1..100, got {self.rounds}")


class RunProgress:
    """Runs done out of the total, with the time left, as one status line on stderr."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.done, self.t0 = total, 0, time.monotonic()
        self._line = StatusLine(quiet)

    def step(self, label: str) -> None:
        self.done += 1
        frac = self.done / self.total
        elapsed = time.monotonic() - self.t0
        eta = elapsed / frac - elapsed
        self._line.show(frac, f"[{'#' * int(frac * 30):<30}] {self.done}/{self.total} {label:<40.40} "
                              f"{elapsed:5.0f}s, ~{eta:4.0f}s left")


def model_facts(engine: Engine) -> dict:
    """Each model the engine runs, by role; "prefill helper" is the unrepacked copy its long
    prompts are decoded on (llama/prefill.py), for a derived format possibly the shipped file."""
    known = {e.installed_path(): e for e in catalog.entries()}
    models = {role: getattr(engine.models, role) for role in ("target", "draft", "slim")}
    if engine.target.prefiller is not None:
        models["prefill helper"] = engine.target.prefiller.helper
    out = {}
    for role, m in models.items():
        if m is None:
            continue
        entry = known.get(m.path)
        out[role] = {"path": str(m.path), "name": entry.name if entry else m.path.name,
                     "sha256": entry.sha256 if entry else target_sha256(m.path), "blocks": m.n_layer}
    return out


def run_bench(cfg: BenchConfig, quiet: bool = False) -> dict:
    cfg.validate()
    prompts = load_prompts(cfg.suite, cfg.categories, cfg.per_category)
    threads = cfg.threads or default_threads()
    kernels = (EXACT_F32 if cfg.f32 else EXACT) if cfg.exact else {}
    common = dict(mode="ar", load=LoadParams(n_ctx=cfg.n_ctx, n_threads=threads, **kernels, **cfg.remote),
                  pull_missing=True, f32=cfg.f32)
    if cfg.tuned and load_choice(engine_pair_name(cfg.pair)) is None:
        raise InvalidParameterError(f"--tuned: pair {engine_pair_name(cfg.pair)} was not tuned on this machine; "
                                    "run `via-edge tune` first")
    # --tuned asks for the tuned configuration, its formats included, whatever VIA_EDGE_FORMAT says
    tuned = Engine.from_pair(cfg.pair, format=AUTO, **common) if cfg.tuned else None
    engine = Engine.from_pair(cfg.pair, tuned=False, spec=cfg.spec, format=cfg.format, **common)
    engines = {"": engine, "tuned": tuned}
    peers: list = []
    try:
        # "<mode>@<format>" and "<peer>@<format>" run on another weight format of the same target
        for fmt in dict.fromkeys(m.partition("@")[2] for m in cfg.modes + cfg.peers if "@" in m):
            engines["@" + fmt] = Engine.from_pair(cfg.pair, tuned=False, spec=cfg.spec, format=fmt, **common)

        def engine_of(method: str) -> Engine:
            """The engine a method runs on (a peer: the one whose file it reads)."""
            if "@" in method:
                return engines["@" + method.partition("@")[2].partition(":")[0]]
            return tuned if method.partition(":")[2] == "tuned" else engine  # json: constrained answers

        for mode in cfg.modes:
            engine_of(mode).prepare(base_mode(mode))
            if tuned is not None and "@" not in mode:
                tuned.prepare(base_mode(mode))
        peers = [make_peer(name, engine_of(name).target_path, cfg.n_ctx, threads, cfg.peer_python, engine.target.eos)
                 for name in cfg.peers]
        # ar:tuned differs from ar only when the tuned choice runs another weight format
        other_format = tuned is not None and tuned.target_path != engine.target_path
        plain = [m for m in cfg.modes if "@" not in m and ":" not in m]
        methods = (list(cfg.modes) + [f"{m}:tuned" for m in plain if tuned and (m != "ar" or other_format)]
                   + [f"{m}:json" for m in plain if cfg.response_format] + [p.name for p in peers])
        formats = {m: engine_of(m).weight_format for m in methods}
        by_name = {p.name: p for p in peers}
        memories = {m: CopyMemory(0 if m.endswith(":nomemory") else cfg.copy_memory) for m in methods}

        def run_one(method: str, tokens: list[int], prompt: Prompt | None = None) -> dict:
            earlier = [engine.tokens_for(text, True) for text in prompt.earlier] if prompt else []
            if method in by_name:
                for before in earlier:
                    by_name[method].run(before, cfg.max_tokens, engine.target.is_eog)
                return by_name[method].run(tokens, cfg.max_tokens, engine.target.is_eog)
            mode, variant = base_mode(method), method.partition(":")[2]
            e = engine_of(method)
            e.memory = memories[method]
            e.reset(memory=False)  # cold caches, a fresh drafter; the method's memory goes on
            for before in earlier:
                e.generate(before, mode=mode, max_tokens=cfg.max_tokens)
            extra = {"response_format": cfg.response_format} if variant == "json" else {}
            if variant == "predicted" and prompt is not None:
                extra["prediction"] = prompt.prediction
            res = e.generate(tokens, mode=mode, max_tokens=cfg.max_tokens, **extra)
            s = res.stats
            return {"tokens": res.tokens, "prefill_s": s.prefill_seconds, "gen_s": s.generate_seconds,
                    "tok_s": s.tokens_per_second, "stats": s.to_dict(), "tiers": res.tiers,
                    "origins": res.origins}

        warm = engine.tokens_for(WARMUP, True)
        for method in methods:
            run_one(method, warm)
        def results_of(runs: list[dict], done: int) -> dict:
            meta = {
                "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "command": cfg.command, "machine": {**machine(), "threads_used": threads},
                "versions": versions(), "models": model_facts(engine) | (
                    {f"{role}:tuned": facts for role, facts in model_facts(tuned).items()
                     if role == "slim" or other_format} if tuned else {}),
                "params": {**{k: v for k, v in asdict(cfg).items() if k not in ("spec", "command")},
                           "spec": {m: asdict(engine.spec) for m in cfg.modes} | (
                               {f"{m}:tuned": asdict(tuned.mode_specs.get(m, tuned.spec)) for m in cfg.modes
                                if m != "ar"} if tuned else {}),
                           "tuned": tuned.tuned.to_dict() if tuned else None, "exact_kernels": cfg.exact,
                           "f32_weights": cfg.f32, "pair": engine_pair_name(cfg.pair)},
                "methods": methods, "formats": formats,
                "attention": {m: engine_of(m).target.params.flash_attn for m in methods if m not in by_name},
                "prompts": [{"id": p.id, "category": p.category, "text": p.text[:200]} for p in prompts[:done]],
            }
            results = {"meta": meta, "runs": runs}
            results["summary"] = summarize(results)
            return results

        bar = RunProgress(len(prompts) * len(methods) * cfg.rounds, quiet)
        runs: list[dict] = []
        done = 0  # prompts every method has run on: a partial result compares only those
        try:
            for i, prompt in enumerate(prompts):
                tokens = prompt_tokens(engine, prompt)
                found = {m: memories[m].copy() for m in methods}  # what every round of this prompt starts from
                for rnd in range(cfg.rounds):
                    if rnd:  # not the answers of the round before
                        memories.update({m: found[m].copy() for m in methods})
                    for position, method in enumerate(in_run_order(methods, i + rnd)):
                        r = run_one(method, tokens, prompt)
                        if prompt.check is not None and not rnd:  # task accuracy: does the answer pass its tests?
                            r["text"] = engine.target.detokenize(r["tokens"])
                            r["passed"] = passes(prompt.check, r["text"])
                        r.update(prompt_id=prompt.id, category=prompt.category, method=method, order=position,
                                 round=rnd, prompt_tokens=len(tokens), generated_tokens=len(r["tokens"]))
                        runs.append(r)
                        bar.step(f"{prompt.category}/{prompt.id} {method}")
                done = i + 1
        except KeyboardInterrupt as exc:
            if done:  # what finished is kept: the caller writes it as results.partial.json
                exc.partial = results_of(runs[:done * len(methods) * cfg.rounds], done)  # type: ignore[attr-defined]
            raise
        return results_of(runs, done)
    finally:
        for p in peers:
            p.close()
        for e in filter(None, engines.values()):
            e.close()


def base_mode(method: str) -> str:
    """The decoding mode of a method name: `lookup` of `lookup@q4_0:predicted`."""
    return method.partition(":")[0].partition("@")[0]


def prompt_tokens(engine: Engine, prompt: Prompt, earlier_max_tokens: int = 512) -> list[int]:
    """A prompt's tokens in the chat template. A multi-turn row's earlier answers are the
    target's own greedy ones (`ar`, untimed), so every method continues the same conversation."""
    if not prompt.turns:
        return engine.tokens_for(prompt.text, True)
    messages: list[dict] = []
    for turn in prompt.turns[:-1]:
        messages.append({"role": "user", "content": turn})
        answer = engine.generate(engine.chat_prompt(messages), mode="ar", max_tokens=earlier_max_tokens)
        messages.append({"role": "assistant", "content": answer.text})
    return engine.chat_prompt(messages + [{"role": "user", "content": prompt.turns[-1]}])


def engine_pair_name(pair: str | None) -> str:
    return catalog.pair(pair)["name"]
