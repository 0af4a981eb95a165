"""The `via-edge` command line. User errors print one line and exit 2, never a traceback.

The options several commands share are declared once (`Opt` groups below) and added to each
command's signature by `@shared(...)`, which hands them to the command as one `Options` value;
the speculation knobs are made from `SpecParams`' fields, so a new knob needs no CLI change.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple, get_type_hints

import typer

from . import derived, models as catalog
from .decoding import SpecParams
from .engine import Engine
from .errors import InvalidParameterError, ViaEdgeError
from .files import write_text
from .formats import AMX_FORMATS, FORMAT_NAMES, OTHER_FORMATS, check_names, default_formats
from .batching import DEFAULT_PARALLEL
from .llama import EXACT, MAX_SEQ
from .modes import DEFAULT_MODE, MODE_NAMES
from .progress import StatusLine
from .sampling import SamplingParams
from .slim import parse_layers
from .tune.survey import QUALITY_FLOOR, check_floor

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  help="Speculative decoding with intra-model routing (VIA-SD) on llama.cpp.")
models_app = typer.Typer(no_args_is_help=True, help="Known models: list, fetch, locate, verify.")
slim_app = typer.Typer(no_args_is_help=True, help="Slim verifiers: derived GGUFs of a target's blocks.")
app.add_typer(models_app, name="models")
app.add_typer(slim_app, name="slim")

# what Ctrl-C interrupts, said when it does (set by each command as it goes)
_activity = {"doing": "the command", "kept": "nothing was written"}


def _err(msg: str) -> None:
    typer.echo(msg, err=True)


def _doing(doing: str, kept: str = "nothing was written") -> None:
    _activity.update(doing=doing, kept=kept)


# ---- shared options ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Opt:
    """One command-line option: its parameter name, type, default, help and valid range."""

    name: str
    type: Any
    default: Any
    help: str
    decls: tuple[str, ...] = ()
    lo: float | None = None
    hi: float | None = None
    show_default: bool = True

    def parameter(self) -> inspect.Parameter:
        option = typer.Option(self.default, *self.decls, help=self.help, show_default=self.show_default)
        return inspect.Parameter(self.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=self.type)


def _tuned_note(default: Any) -> str:
    # parentheses, not brackets: typer's help renderer would read [..] as markup and drop it
    return f" (default: tuned, else {default})"


def _spec_opts() -> tuple[Opt, ...]:
    hints = get_type_hints(SpecParams)
    return tuple(Opt(f.name, Optional[hints[f.name]], None, f.metadata["help"] + _tuned_note(f.default),
                     show_default=False) for f in dataclasses.fields(SpecParams))


MODEL_OPTS = (
    Opt("pair", Optional[str], None, "Catalog pair (default: qwen2.5-coder)."),
    Opt("target", Optional[str], None, "Target GGUF path or catalog name (overrides --pair)."),
    Opt("draft", Optional[str], None, "Draft GGUF path or catalog name."),
    Opt("slim", Optional[str], None, "Slim verifier GGUF (default: built from --slim-layers)."),
    Opt("draft_layers", Optional[str], None, "Use a slim of the target as the draft, e.g. 0-11."),
    Opt("slim_layers", Optional[str], None, "Target blocks for the slim verifier, e.g. 0-3,14-27"
        + _tuned_note("the catalog's")),
    Opt("untuned", bool, False, "Ignore the pair's tuned choice (via-edge tune) on this machine.", ("--untuned",)),
)
RUN_OPTS = (
    Opt("ctx", Optional[int], None, "Context window in tokens (default 4096; serve: the total over its --parallel "
        "slots, default 4096 per slot).", lo=16, hi=1 << 20),
    Opt("threads", Optional[int], None, "CPU threads (default: all cores).", lo=1, hi=1024),
    Opt("gpu_layers", int, -1, "Layers to offload to Metal/GPU (-1: all; CPU builds ignore it).", lo=-1, hi=100000),
    Opt("flash_attn", Optional[bool], None, "Default: auto.", ("--flash-attn/--no-flash-attn",)),
    Opt("exact", bool, False, "No weight repacking: verification batches of up to 7 tokens then compute exactly "
        "what single decodes do, so greedy sd (n_draft <= 6) equals ar (slower).", ("--exact",)),
    Opt("kv_type", str, "f16", "KV cache type: f16, f32 or q8_0."),
    Opt("verbose", bool, False, "Show llama.cpp's log.", ("--verbose", "-v")),
)
SAMPLING_OPTS = (
    Opt("temperature", float, 0.0, "0 = greedy."),
    Opt("top_k", int, 0, "0 = off."),
    Opt("top_p", float, 1.0, "Nucleus sampling mass (1 = off)."),
    Opt("min_p", float, 0.0, "Drop tokens below this share of the top one's probability."),
    Opt("seed", Optional[int], None, "Seed for reproducible sampling."),
)
SPEC_OPTS = _spec_opts()
SPEC_KNOBS = tuple(o.name for o in SPEC_OPTS)
# ranges of the commands' own numeric options, checked before anything loads
RANGES = {"max_tokens": (1, 1 << 20), "port": (0, 65535), "max_body": (1, None), "max_tokens_limit": (1, None),
          "per_category": (1, None), "search_evals": (1, None), "calib_tokens": (2, None), "heldout": (1, None),
          "verify_tokens": (2, None), "repeats": (1, None), "parallel": (1, MAX_SEQ), "max_queue": (0, 4096),
          "drain": (0, 3600)}


@dataclass
class Options:
    """The shared options of one command invocation, by name."""

    values: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    def spec_overrides(self) -> dict[str, Any]:
        return {k: self.values[k] for k in SPEC_KNOBS if self.values.get(k) is not None}

    def sampling(self) -> dict[str, Any]:
        return {o.name: self.values[o.name] for o in SAMPLING_OPTS if o.name in self.values}

    def engine(self, mode: str | None, fallback_mode: str = DEFAULT_MODE, progress: bool = False,
               n_parallel: int = 1) -> Engine:
        """The engine these options describe: a pair (with its tuned choice) or explicit files.

        Knobs left unset come from the pair's tuned choice on this machine when there is one
        (`via-edge tune`), else from SpecParams' defaults.
        """
        v = self.values
        kw: dict[str, Any] = dict(n_ctx=v["ctx"] or 4096 * n_parallel, n_parallel=n_parallel, n_threads=v["threads"], n_gpu_layers=v["gpu_layers"],
                                  flash_attn=v["flash_attn"], kv_type=v["kv_type"], pull_missing=True,
                                  progress=_load_progress if progress else None)
        if v["exact"]:
            kw.update(EXACT)
        for key, value in (("draft_layers", v["draft_layers"]), ("slim_layers", v["slim_layers"]), ("mode", mode)):
            if value:
                kw[key] = value
        _doing("loading the models", "nothing was written (a model download in progress keeps its partial file)")
        if v["target"]:
            kw.setdefault("mode", fallback_mode)
            return Engine(v["target"], v["draft"], v["slim"], spec=SpecParams(**self.spec_overrides()), **kw)
        if v["draft"] or v["slim"]:
            raise ViaEdgeError("--draft and --slim need --target (or use --pair)")
        return Engine.from_pair(v["pair"], tuned=not v["untuned"], overrides=self.spec_overrides(),
                                fallback_mode=fallback_mode, **kw)


def _check_range(name: str, value: Any, lo: float | None, hi: float | None) -> None:
    if value is None or isinstance(value, bool):
        return
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        span = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ViaEdgeError(f"--{name.replace('_', '-')} must be {'in ' if hi is not None else ''}{span}, got {value}")


def _check_values(opts: Options) -> None:
    """Sampling values, decoding knobs and layer sets, checked before any model loads."""
    v = opts.values
    if "temperature" in v:
        SamplingParams(**{k: x for k, x in opts.sampling().items() if x is not None})
    if any(k in v for k in SPEC_KNOBS):
        SpecParams(**opts.spec_overrides())
    for name in ("draft_layers", "slim_layers"):
        if v.get(name):
            parse_layers(v[name], None)


def shared(*groups: tuple[Opt, ...]) -> Callable[[Callable], Callable]:
    """Add the options of `groups` to a command and pass them to it as `opts`; check every
    numeric option's range (shared or the command's own) before the command runs."""
    opts = [o for g in groups for o in g]

    def wrap(fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        own = [p for p in sig.parameters.values() if p.name != "opts"]
        hints = {k: v for k, v in get_type_hints(fn).items() if k != "opts"}

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            for o in opts:
                _check_range(o.name, kwargs.get(o.name), o.lo, o.hi)
            for name, (lo, hi) in RANGES.items():
                _check_range(name, kwargs.get(name), lo, hi)
            values = {o.name: kwargs.pop(o.name) for o in opts}
            _check_values(Options(values))
            _logging(bool(values.get("verbose")))
            if "opts" in sig.parameters:
                kwargs["opts"] = Options(values)
            try:
                return fn(**kwargs)
            except KeyboardInterrupt:  # here, not in main(): typer turns it into a silent exit 130
                _err(f"\ninterrupted: {_activity['doing']} stopped; {_activity['kept']}")
                raise SystemExit(130) from None

        command.__signature__ = sig.replace(parameters=own + [o.parameter() for o in opts])
        command.__annotations__ = {**hints, **{o.name: o.type for o in opts}}
        return command

    return wrap


def _mode_opt(fallback: str, what: str = "Decoding mode") -> Any:
    return typer.Option(None, help=f"{what}: {', '.join(MODE_NAMES)} (default: tuned, else {fallback}).",
                        show_default=False)


# ---- commands ------------------------------------------------------------------------------------
@app.command()
@shared(MODEL_OPTS, SPEC_OPTS, SAMPLING_OPTS, RUN_OPTS)
def generate(
    prompt: Optional[str] = typer.Argument(None, help="The prompt (a user message unless --raw); - reads it "
                                           "from standard input.", show_default=False),
    prompt_file: Optional[Path] = typer.Option(None, help="Read the prompt from this file (long prompts)."),
    mode: Optional[str] = _mode_opt(DEFAULT_MODE),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Maximum new tokens."),
    stop: List[str] = typer.Option([], help="Stop string (repeatable)."),
    raw: bool = typer.Option(False, help="Do not apply the chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with text, stats and timings."),
    opts: Options = None,
) -> None:
    """Generate text for PROMPT with the target alone (ar) or speculatively (sd, via, hier, lookup)."""
    from .compat import timings

    text = _read_prompt(prompt, prompt_file)
    with opts.engine(mode) as engine:
        _doing("generation", "nothing was written")
        stream = engine.stream(text, max_tokens=max_tokens, stop=stop, mode=engine.mode, chat_template=not raw,
                               **opts.sampling())
        for piece in stream:
            if not as_json:
                sys.stdout.write(piece.text)
                sys.stdout.flush()
        res = stream.result
        s = res.stats
        if as_json:
            out = res.to_dict()
            out["models"] = {role: str(m.path) for role in ("target", "draft", "slim")
                             if (m := getattr(engine.models, role)) is not None}
            out["timings"] = timings(res)
            typer.echo(json.dumps(out, indent=2))
        else:
            sys.stdout.write("\n")
            _err(f"[{res.mode}] {s.generated_tokens} tokens, {s.tokens_per_second:.1f} tok/s "
                 f"(prompt {s.prompt_tokens} tokens, {s.prompt_tokens_per_second:.0f} tok/s)"
                 + (f", accepted {s.draft_n_accepted}/{s.draft_n} drafted, {s.mean_accepted_per_round:.1f} per "
                    f"round, drafts of {s.mean_draft_length:.1f}" if s.draft_n else "")
                 + (f", {s.copied_tokens} copied from the context, {s.generated_tokens - s.copied_tokens} "
                    f"generated" if res.mode == "lookup" else "")
                 + (f", tiers A/B/C {s.tier_a}/{s.tier_b}/{s.tier_c}" if res.mode == "via" else ""))


def _read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if prompt is not None and prompt_file is not None:
        raise ViaEdgeError("give the prompt as an argument or with --prompt-file, not both")
    if prompt_file is not None:
        try:
            text = prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ViaEdgeError(f"cannot read --prompt-file {prompt_file}: {exc}") from exc
    elif prompt == "-":
        text = sys.stdin.read()
    elif prompt is None:
        raise ViaEdgeError("no prompt: give it as an argument, - for standard input, or --prompt-file PATH")
    else:
        text = prompt
    if not text.strip():
        raise ViaEdgeError("the prompt is empty")
    return text


def _counts(name: str, text: str, lo: int, hi: int) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ViaEdgeError(f"--{name} takes comma-separated whole numbers, got {text!r}") from None
    if not values or any(not lo <= v <= hi for v in values):
        raise ViaEdgeError(f"--{name} values must be in {lo}..{hi}, got {text!r}")
    return values


def _bench_serve(pair: str | None, suite: str, categories: str | None, max_tokens: int, out: Path,
                 threads: int | None, clients: str, parallel: str, requests: int, repeats: int,
                 mode: str | None) -> None:
    from .bench import load as L
    from .bench.suite import load_prompts

    counts = _counts("clients", clients, 1, 256)
    slots = _counts("parallel", parallel, 1, MAX_SEQ)
    _check_range("requests", requests, 1, 100000)
    _check_range("repeats", repeats, 1, 1000)
    if mode is not None and mode not in MODE_NAMES:
        raise ViaEdgeError(f"--modes for --serve takes one mode ({', '.join(MODE_NAMES)}), got {mode!r}")
    cats = [c.strip() for c in categories.split(",")] if categories else None
    pool = load_prompts(suite, cats, max(1, -(-requests // len(cats or [0] * 13))))
    by_cat: dict[str, list] = {}
    for p in pool:
        by_cat.setdefault(p.category, []).append(p)
    prompts = [q for group in zip(*by_cat.values()) for q in group][:requests]  # categories in turn
    if len(prompts) < requests:
        prompts = (pool * requests)[:requests]
    args = (["--pair", pair] if pair else []) + (["--threads", str(threads)] if threads else []) \
        + (["--mode", mode] if mode else [])
    cfg = L.LoadConfig(prompts, counts, slots, max_tokens=max_tokens, repeats=repeats, server_args=args,
                       command="via-edge " + " ".join(sys.argv[1:]))
    _doing("the load benchmark", f"nothing was written to {out}")
    results = L.run_load(cfg, log=_err)
    for path in L.write_load(results, out):
        typer.echo(str(path))
    for row in results["summary"]:
        typer.echo(f"  {row['server']:14s} {row['clients']:3d} clients {row['tok_s']:7.1f} tok/s  "
                   f"{row['ratio']:.2f}x one-at-a-time  p50 {row['latency_p50']:.2f} s  TTFT p50 {row['ttft_p50']:.2f} s")


@app.command()
@shared(SPEC_OPTS)
def bench(
    pair: Optional[str] = typer.Option(None, help="Catalog pair (default: qwen2.5-coder)."),
    modes: str = typer.Option("ar,sd,via,hier,lookup", help="Comma-separated modes; must include ar."),
    suite: str = typer.Option("spec-bench", help="spec-bench, or a JSONL file with 'prompt' or 'turns'."),
    categories: Optional[str] = typer.Option(None, help="Comma-separated categories (default: all)."),
    per_category: int = typer.Option(1, help="Prompts per category (the first ones, in file order)."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n"),
    out: Path = typer.Option(Path("bench-out"), help="Folder for results.json, report.md, speedup.png."),
    quick: bool = typer.Option(False, help="SmolLM2-135M (F32 copy, exact kernels) with a slim of itself "
                               "as draft, 4 prompts: about a minute."),
    peers: bool = typer.Option(True, "--peers/--no-peers", help="Also measure llama-cpp-python's Llama."),
    peer: Optional[List[str]] = typer.Option(None, help="Only these peers (repeatable): llama-cpp-python, "
                                             "llama-cpp-python-lookup."),
    peer_python: Optional[str] = typer.Option(None, help="Run the peers with this Python, e.g. an environment "
                                              "holding another llama.cpp build (docs/benchmarks.md, section 19)."),
    exact: bool = typer.Option(False, help="Exact kernels (see generate --exact): lossless modes match ar."),
    tuned: bool = typer.Option(False, "--tuned", help="Also run every mode with the pair's tuned knobs and slim "
                               "(via-edge tune), as <mode>:tuned beside the defaults, interleaved."),
    compare: Optional[Tuple[Path, Path]] = typer.Option(None, help="Diff two results files instead of running."),
    ctx: int = typer.Option(4096, help="Context window (tokens; --serve: each server's own default)."),
    threads: Optional[int] = typer.Option(None, help="CPU threads (default: all cores)."),
    serve: bool = typer.Option(False, "--serve", help="Load benchmark instead: start `via-edge serve` with "
                               "--parallel 1 and each --parallel count, drive them with the openai client."),
    clients: str = typer.Option("1,2,4,8", help="--serve: concurrent client counts."),
    parallel_list: str = typer.Option(str(DEFAULT_PARALLEL), "--parallel", help="--serve: slot counts to compare "
                                 "with one-at-a-time (--parallel 1), comma-separated."),
    requests: int = typer.Option(16, help="--serve: requests per run (Spec-Bench prompts, categories in turn)."),
    repeats: int = typer.Option(3, help="--serve: repeats of every (server, clients) run."),
    opts: Options = None,
) -> None:
    """Measure speed and fidelity of every mode side by side, interleaved on the same prompts.

    The speculation knobs apply to the untuned runs (default: SpecParams' defaults). With --serve,
    the load benchmark: aggregate throughput and latency of concurrent clients (docs/benchmarks.md)."""
    from . import bench as B

    _check_range("ctx", ctx, 16, 1 << 20)
    _check_range("threads", threads, 1, 1024)
    if compare:
        typer.echo(B.compare(B.load_results(compare[0]), B.load_results(compare[1])))
        return
    if serve:
        _bench_serve(pair, suite, categories, max_tokens, out, threads, clients, parallel_list, requests, repeats,
                     modes if modes != "ar,sd,via,hier,lookup" else None)
        return
    cfg = B.BenchConfig(pair=pair, modes=[m.strip() for m in modes.split(",") if m.strip()],
                        peers=(list(peer) if peer else list(B.PEERS)) if peers else [], peer_python=peer_python,
                        suite=suite, categories=[c.strip() for c in categories.split(",")] if categories else None,
                        per_category=per_category, max_tokens=max_tokens, exact=exact, n_ctx=ctx,
                        threads=threads, tuned=tuned, quick=quick, command="via-edge " + " ".join(sys.argv[1:]),
                        spec=SpecParams(**opts.spec_overrides()))
    if quick:
        cfg.pair = pair or B.QUICK["pair"]
        cfg.categories = cfg.categories or B.QUICK["categories"]
        cfg.max_tokens = B.QUICK["max_tokens"] if max_tokens == 128 else max_tokens
        cfg.exact = cfg.f32 = True  # quantized kernels differ between batch and single: see build_f32
    _doing("the benchmark", f"nothing was written to {out}")
    try:
        results = B.run_bench(cfg)
    except KeyboardInterrupt as exc:
        partial = getattr(exc, "partial", None)
        if partial is not None:
            path = write_text(out / "results.partial.json", json.dumps(partial, indent=1))
            _doing("the benchmark", f"the {len(partial['meta']['prompts'])} prompts every method had finished "
                   f"are kept in {path}")
        raise
    for path in B.write_outputs(results, out):
        typer.echo(str(path))
    for method, s in results["summary"].items():
        typer.echo(f"  {method:24s} {s['tok_s']['median']:7.1f} tok/s  speedup {s['speedup']:.2f}x  "
                   f"agreement {s['fidelity']['agreement_mean']:.2f}")


@app.command()
@shared(MODEL_OPTS, SPEC_OPTS, SAMPLING_OPTS, RUN_OPTS)
def chat(
    mode: Optional[str] = _mode_opt(DEFAULT_MODE),
    system: Optional[str] = typer.Option(None, help="System message."),
    show_tiers: bool = typer.Option(False, help="Colour each token by origin: green draft, cyan copied from the context, yellow slim, blue target."),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="Maximum tokens per answer."),
    opts: Options = None,
) -> None:
    """Chat in the terminal, streaming, multi-turn (/help inside lists the commands)."""
    from .chat import run

    with opts.engine(mode, progress=True) as engine:
        _tuning_hint(engine, opts.target)
        _doing("the chat", "nothing was written")
        run(engine, system=system, max_tokens=max_tokens, show_tiers=show_tiers, **opts.sampling())


@app.command()
@shared(MODEL_OPTS, SPEC_OPTS, RUN_OPTS)
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to listen on (loopback by default)."),
    port: int = typer.Option(8080, help="Port to listen on."),
    mode: Optional[str] = _mode_opt(DEFAULT_MODE, "Default decoding mode; requests may set 'mode'"),
    max_body: int = typer.Option(1 << 20, help="Largest request body in bytes."),
    max_tokens_limit: int = typer.Option(4096, help="Largest max_tokens a request may ask for."),
    parallel: int = typer.Option(DEFAULT_PARALLEL, "--parallel", "-np", help="Requests generated at once, batched "
                                 "into shared decodes (slots; the context is split over them)."),
    max_queue: int = typer.Option(16, help="Requests that may wait for a slot; one more gets a 503."),
    drain: float = typer.Option(10.0, help="On SIGTERM or Ctrl-C, seconds running generations may take to "
                                "finish before they are cancelled."),
    opts: Options = None,
) -> None:
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models, /health)."""
    from .server import bind, run

    sock = bind(host, port)  # a busy port fails here, before a model loads
    with sock, opts.engine(mode, progress=True, n_parallel=parallel) as engine:
        _tuning_hint(engine, opts.target)
        _doing("the server", "nothing was written")
        url = f"http://{host}:{sock.getsockname()[1]}/v1"
        slots = f", {parallel} slots of {engine.target.n_ctx} tokens" if parallel > 1 else ""
        run(engine, sock, on_ready=lambda: _err(f"via-edge serving {engine.model_name} ({engine.mode}{slots}) "
                                                f"on {url}"),
            drain=drain, max_body=max_body, max_tokens_limit=max_tokens_limit, max_queue=max_queue)


@app.command()
@shared()
def tune(
    pair: Optional[str] = typer.Option(None, help="Catalog pair (default: qwen2.5-coder)."),
    fidelity_floor: float = typer.Option(0.95, help="Lossy modes (via) must keep at least this predicted "
                                         "token agreement with the target's greedy output."),
    slim_budget: float = typer.Option(0.75, help="A slim may cost at most this share of the target's "
                                      "verification call."),
    search_evals: int = typer.Option(20, help="Slims the layer search may build and score."),
    calib_tokens: int = typer.Option(48, help="Target tokens recorded per calibration prompt."),
    heldout: int = typer.Option(4, help="Held-out prompts for the real check of the prediction."),
    verify_tokens: int = typer.Option(48, help="Tokens per held-out prompt in the real check."),
    repeats: int = typer.Option(2, help="Repeats of each cost measurement (medians kept)."),
    ctx: int = typer.Option(4096, help="Context window (tokens)."),
    threads: Optional[int] = typer.Option(None, help="CPU threads (default: all cores)."),
    formats_list: Optional[str] = typer.Option(None, "--formats", help="Weight formats to try for target and draft "
                                               "(comma-separated; 'shipped' alone skips the format step; default: "
                                               "this build's, see `models optimize --help`)."),
    quality_floor: float = typer.Option(QUALITY_FLOOR, help="A derived format must keep at least this teacher-forced "
                                        "top-1 agreement with the shipped file (0..1)."),
    out: Optional[Path] = typer.Option(None, help="Also write report.md, tune.json and frontier.png here."),
    replace: bool = typer.Option(False, "--replace", help="Replace a stored choice even when it was made over "
                                 "formats this run does not try."),
) -> None:
    """Measure this machine, try faster weight formats, search the slim verifier, predict every
    configuration offline, check the prediction with a real run, and store the choice generate,
    chat, serve and the API then use."""
    from .tune.report import write_outputs
    from .tune.tuner import TuneConfig, tune as run_tune

    _check_range("ctx", ctx, 16, 1 << 20)
    _check_range("threads", threads, 1, 1024)
    names = _format_names(formats_list)
    check_floor(quality_floor)
    cfg = TuneConfig(pair=pair, fidelity_floor=fidelity_floor, slim_budget=slim_budget, search_evals=search_evals,
                     calib_tokens=calib_tokens, heldout=heldout, verify_tokens=verify_tokens, repeats=repeats,
                     n_ctx=ctx, threads=threads, formats=names, quality_floor=quality_floor, replace=replace)
    _doing("tuning", "the stored choice is unchanged")
    result = run_tune(cfg)
    paths = write_outputs(result, out)
    typer.echo(result["choice"]["summary"])
    for p in [result["paths"]["profile"], result["paths"]["choice"], *map(str, paths)]:
        typer.echo(f"  wrote {p}")


@app.command()
def info() -> None:
    """This machine and the llama.cpp build in use: flavor, features, CPU, where models and tuned
    choices live. Tuned choices are kept per machine and build: one made on another is not used."""
    from .llama import default_threads
    from .machine import build, cpu_name, has_amx, machine_key, versions
    from .tuned import tuned_dir

    b, v = build(), versions()
    typer.echo(f"via-edge {v['via_edge']}, llama-cpp-python {v['llama-cpp-python']}")
    typer.echo(f"llama.cpp build: {b['flavor']} ({b['source']}; AMX self-check: {b['self_check']})")
    typer.echo(f"features: {' '.join(b['features'])}")
    typer.echo(f"cpu: {cpu_name()}, {default_threads()} threads available; AMX in the CPU: "
               f"{'yes' if has_amx() else 'no'}")
    typer.echo(f"machine key: {machine_key()}  (CPU, cores and build: what tuned choices are kept under)")
    typer.echo(f"models: {catalog.model_dir()}  (VIA_EDGE_MODEL_DIR)")
    mine = sorted(p.name.split("--")[0] for p in tuned_dir().glob(f"*--{machine_key()}.choice.json"))
    others = sorted(p.name for p in tuned_dir().glob("*.choice.json") if machine_key() not in p.name)
    typer.echo(f"tuned choices: {tuned_dir()}; for this machine and build: {', '.join(mine) or 'none'}"
               + (f"; {len(others)} made elsewhere (not used here)" if others else ""))


def _version(value: bool) -> None:
    if value:
        from .machine import build, versions

        v = versions()
        typer.echo(f"via-edge {v['via_edge']} (llama-cpp-python {v['llama-cpp-python']}, "
                   f"llama.cpp {build()['flavor']} build)")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and the llama.cpp build, then exit.")) -> None:
    """Speculative decoding with intra-model routing (VIA-SD) on llama.cpp."""


# ---- models ----------------------------------------------------------------------------------------
@models_app.command("list")
@shared()
def models_list() -> None:
    """Known models and pairs, where they are and whether they are present."""
    typer.echo(f"model dir: {catalog.model_dir()}  (set VIA_EDGE_MODEL_DIR to change)")
    for e in catalog.entries():
        path = e.installed_path()
        state = f"present  {path}" if path else "missing"
        typer.echo(f"  {e.name:30s} {e.spec['architecture']:8s} {e.size / 1e6:8.1f} MB  {state}")
    cat = catalog.load_catalog()
    for name, p in cat["pairs"].items():
        default = "  (default)" if name == cat["default_pair"] else ""
        draft = p.get("draft") or f"slim {p.get('draft_layers')} of the target"
        typer.echo(f"  pair {name}: target {p['target']}, draft {draft}, slim {p.get('slim_layers')}{default}")
    files = derived.derived_files()
    used = derived.in_use(files)
    typer.echo(f"derived files: {len(files)}, {sum(d.size for d in files) / 1e9:.1f} GB "
               "(`models rm FILE`, `models prune` deletes those no tuned choice uses)")
    for d in files:
        use = f"  in use: tuned {used[d.path]}" if d.path in used else ""
        typer.echo(f"  {d.size / 1e9:5.2f} GB  {d.kind:20s} of {derived.source_name(d.source):28s} {d.path}{use}")


@models_app.command("rm")
@shared()
def models_rm(files: List[str] = typer.Argument(..., help="Derived files (paths or names, as `models list` "
                                                           "shows them).")) -> None:
    """Delete derived files (formats, slims, F32 copies); via-edge makes them again when needed."""
    known = derived.derived_files()
    chosen = [derived.find(name, known) for name in files]  # every name checked before anything goes
    freed = sum(derived.remove(d.path) for d in chosen)
    typer.echo(f"deleted {len(chosen)} files, {freed / 1e9:.2f} GB")


@models_app.command("prune")
@shared()
def models_prune(dry_run: bool = typer.Option(False, "--dry-run", help="Only say what would go."),
                 everything: bool = typer.Option(False, "--all", help="Also the files tuned choices use.")) -> None:
    """Delete the derived files no tuned choice uses (all of them with --all)."""
    files = derived.derived_files()
    used = {} if everything else derived.in_use(files)
    gone = [d for d in files if d.path not in used]
    for d in gone:
        typer.echo(f"  {'would delete' if dry_run else 'deleting'} {d.kind} ({d.size / 1e9:.2f} GB) {d.path}")
    freed = sum(d.size for d in gone) if dry_run else sum(derived.remove(d.path) for d in gone)
    typer.echo(f"{'would free' if dry_run else 'freed'} {freed / 1e9:.2f} GB; kept {len(used)} in use by tuned choices")


@models_app.command("pull")
@shared()
def models_pull(name: str = typer.Argument(..., help="Model or pair name.")) -> None:
    """Fetch a model (or both models of a pair), verify its SHA-256 and put it in place."""
    _doing(f"the download of {name}", f"the partial download is kept; `via-edge models pull {name}` resumes it")
    typer.echo(str(catalog.pull(name)))


@models_app.command("path")
@shared()
def models_path(name: str) -> None:
    """Print the file of a present model (exit 2 if it is not downloaded)."""
    typer.echo(str(catalog.resolve(name)))


@models_app.command("verify")
@shared()
def models_verify(name: str) -> None:
    """Recompute a present model's SHA-256 against the catalog."""
    _doing(f"the check of {name}")
    if not catalog.verify(name):
        raise ViaEdgeError(f"{name}: SHA-256 does not match the catalog; delete it and pull again")
    typer.echo(f"{name}: ok")


@models_app.command("optimize")
@shared()
def models_optimize(
    name: str = typer.Argument(..., help="Pair, catalog model or GGUF path."),
    formats_list: Optional[str] = typer.Option(None, "--formats", help="Formats to derive and measure (comma-"
                                               f"separated, of {', '.join(FORMAT_NAMES)}; default with AMX kernels: "
                                               f"{','.join(AMX_FORMATS)}, else {','.join(OTHER_FORMATS)})."),
    quality_floor: float = typer.Option(QUALITY_FLOOR, help="Teacher-forced top-1 agreement with the source a "
                                        "format must keep to be picked (0..1)."),
    prompts: int = typer.Option(12, help="Calibration prompts (Spec-Bench, one per category) for the quality figures."),
    tokens: int = typer.Option(48, help="Source tokens per calibration prompt."),
    repeats: int = typer.Option(5, help="Repeats of each cost measurement (medians kept)."),
    threads: Optional[int] = typer.Option(None, help="CPU threads (default: all cores)."),
    out: Optional[Path] = typer.Option(None, help="Also write the table (optimize.md) and figures (optimize.json) "
                                       "into this folder."),
) -> None:
    """The format step of `via-edge tune` alone: derive each weight format of the model(s), print
    what decoding 1, 4 and 8 tokens costs in each on this machine and how far each departs from
    the source (agreement, KL, perplexity), and which format plain decoding would run fastest in."""
    from .files import write_json
    from .llama import LlamaModel, LoadParams
    from .prompts import chat_tokens
    from .tune.record import calibration_prompts
    from .tune.survey import pick, survey, table

    names = _format_names(formats_list)
    check_floor(quality_floor)
    _check_range("prompts", prompts, 1, 100)
    _check_range("tokens", tokens, 1, 1024)
    _check_range("repeats", repeats, 1, 100)
    _check_range("threads", threads, 1, 1024)
    cat = catalog.load_catalog()
    if name in cat["pairs"]:
        p = catalog.pair(name)
        sources = {"target": catalog.resolve(p["target"], pull_missing=True)}
        if p.get("draft"):
            sources["draft"] = catalog.resolve(p["draft"], pull_missing=True)
    else:
        sources = {"model": catalog.resolve(name, pull_missing=True)}
    load = LoadParams(n_ctx=4096, n_threads=threads)
    _doing("the format survey", "finished variants are kept; an unfinished one left no file under its name")
    with LlamaModel(sources[next(iter(sources))], load) as m:
        cal = [chat_tokens(m, [{"role": "user", "content": q.text}]) for q in calibration_prompts(1)[:prompts]]
    rows = survey(sources, names, cal, load, continuation=tokens, repeats=repeats, log=_err)
    text = table(rows, quality_floor)
    typer.echo(text)
    for role, rs in rows.items():
        best, shipped = pick(rs, quality_floor), rs[0]
        typer.echo(f"{role}: plain decoding would run {best.format} ({best.path.name}), "
                   f"{shipped.cost[1] / best.cost[1]:.2f}x the shipped file's tokens per second"
                   + (f", agreement {best.quality.agreement:.3f} with it" if best.quality else ""))
    if out:
        write_text(Path(out) / "optimize.md", text + "\n")
        write_json(Path(out) / "optimize.json", {"floor": quality_floor, "sources": {k: str(v) for k, v in sources.items()},
                                                "rows": {r: [x.to_dict() for x in rs] for r, rs in rows.items()}})


def _format_names(raw: str | None) -> tuple[str, ...]:
    if raw is None:
        return default_formats()
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    if not names:
        raise InvalidParameterError("--formats needs at least one format name")
    check_names(list(names))
    return names


# ---- slim ------------------------------------------------------------------------------------------
@slim_app.command("build")
@shared()
def slim_build(
    target: str = typer.Argument(..., help="Target GGUF path or catalog name."),
    layers: str = typer.Option(..., help="Blocks to keep, e.g. 0-20 or 0-3,14-27."),
    out: Optional[Path] = typer.Option(None, help="Output path (default: next to the target); an existing file "
                                       "there is replaced only if it is this very slim."),
) -> None:
    """Write the derived GGUF of TARGET's chosen blocks (reused when present)."""
    from .slim import build_slim

    _doing("building the slim", "no file was left under the output name")
    typer.echo(str(build_slim(catalog.resolve(target, pull_missing=True), layers, out)))


def _tuning_hint(engine: Engine, target: Optional[str]) -> None:
    if engine.tuned is None and not target:
        _err(f"note: no tuned choice for this pair on this machine, so mode {engine.mode} with default knobs; "
             "`via-edge tune` measures which mode is fastest here")


_loading: dict[str, StatusLine] = {}


def _load_progress(role: str, frac: float) -> None:
    """One status line per model load; a finished line is dropped, so a later load of the same role shows too."""
    what = "measuring the target's batch costs (once on this machine)" if role == "batch costs" else \
        f"loading {role} model"
    _loading.setdefault(role, StatusLine()).show(frac, f"{what} {int(frac * 100):3d}%")
    if frac >= 1.0:
        del _loading[role]


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if verbose:
        logging.getLogger("via_edge").setLevel(logging.INFO)
        logging.getLogger("via_edge.llama").setLevel(logging.INFO)


def main() -> None:
    try:
        app()
    except ViaEdgeError as exc:
        _err(f"error: {exc}")
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        _err(f"\ninterrupted: {_activity['doing']} stopped; {_activity['kept']}")
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
