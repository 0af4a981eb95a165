"""The `via-edge` command line. User errors print one line and exit 2, never a traceback."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import List, Optional, Tuple

import typer

from . import models as catalog
from .decoding import SpecParams
from .engine import ENGINE_MODES, Engine
from .errors import ViaEdgeError
from .llama import EXACT

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  help="Speculative decoding with intra-model routing (VIA-SD) on llama.cpp.")
models_app = typer.Typer(no_args_is_help=True, help="Known models: list, fetch, locate, verify.")
slim_app = typer.Typer(no_args_is_help=True, help="Slim verifiers: derived GGUFs of a target's blocks.")
app.add_typer(models_app, name="models")
app.add_typer(slim_app, name="slim")


def _err(msg: str) -> None:
    typer.echo(msg, err=True)


class ModelOptions:
    """The options every command that loads models shares, turned into an Engine.

    Speculation knobs left unset (None) come from the pair's tuned choice on this machine when
    there is one (`via-edge tune`), else from SpecParams' defaults.
    """

    KNOBS = ("n_draft", "tau_accept", "tau_full", "route", "max_lag", "hier_block", "p_min", "n_min")

    def __init__(self, args: dict, fallback_mode: str) -> None:
        self.args, self.fallback_mode = args, fallback_mode

    @classmethod
    def from_args(cls, args: dict, fallback_mode: str = "ar") -> "ModelOptions":
        """From a command's own arguments (the shared options below, by name)."""
        return cls(dict(args), fallback_mode)

    def engine(self, progress: bool = False) -> Engine:
        a = self.args
        overrides = {k: a[k] for k in self.KNOBS if a.get(k) is not None}
        kw = dict(n_ctx=a["ctx"], n_threads=a["threads"], n_gpu_layers=a["gpu_layers"], flash_attn=a["flash_attn"],
                  kv_type=a["kv_type"], pull_missing=True, progress=_load_progress if progress else None)
        if a["exact"]:
            kw.update(EXACT)
        for key in ("draft_layers", "slim_layers", "mode"):
            if a.get(key):
                kw[key] = a[key]
        if a["target"]:
            kw.setdefault("mode", self.fallback_mode)
            return Engine(a["target"], a["draft"], a["slim"], spec=SpecParams(**overrides), **kw)
        if a["draft"] or a["slim"]:
            raise ViaEdgeError("--draft and --slim need --target (or use --pair)")
        return Engine.from_pair(a["pair"], tuned=not a.get("untuned"), overrides=overrides,
                                fallback_mode=self.fallback_mode, **kw)


# options shared by generate, chat and serve (typer lets one Option object serve several commands)
PAIR = typer.Option(None, help="Catalog pair (default: qwen2.5-coder).")
TARGET = typer.Option(None, help="Target GGUF path or catalog name (overrides --pair).")
DRAFT = typer.Option(None, help="Draft GGUF path or catalog name.")
SLIM = typer.Option(None, help="Slim verifier GGUF (default: built from --slim-layers).")
DRAFT_LAYERS = typer.Option(None, help="Use a slim of the target as the draft, e.g. 0-11.")
SLIM_LAYERS = typer.Option(None, help="Target blocks for the slim verifier, e.g. 0-3,14-27 [default: tuned, "
                           "else the catalog's].")
_D = SpecParams()
TUNED_NOTE = " [default: tuned, else {}]"
N_DRAFT = typer.Option(None, help="Draft tokens per round." + TUNED_NOTE.format(_D.n_draft), show_default=False)
P_MIN = typer.Option(None, help="Stop drafting when the draft's top probability is below this."
                     + TUNED_NOTE.format(_D.p_min), show_default=False)
N_MIN = typer.Option(None, help="Draft at least this many tokens before p_min applies."
                     + TUNED_NOTE.format(_D.n_min), show_default=False)
TAU_ACCEPT = typer.Option(None, help="via: keep a draft token at or above this routing score."
                          + TUNED_NOTE.format(_D.tau_accept), show_default=False)
TAU_FULL = typer.Option(None, help="via: send to the target below this score (>1: always)."
                        + TUNED_NOTE.format(_D.tau_full), show_default=False)
ROUTE = typer.Option(None, help="via: routing score from slim, draft or both." + TUNED_NOTE.format(_D.route),
                     show_default=False)
MAX_LAG = typer.Option(None, help="via: the target verifies at least every this many tokens (0: never forced)."
                       + TUNED_NOTE.format(_D.max_lag), show_default=False)
HIER_BLOCK = typer.Option(None, help="hier: tokens per target verification." + TUNED_NOTE.format(_D.hier_block),
                          show_default=False)
UNTUNED = typer.Option(False, "--untuned", help="Ignore the pair's tuned choice (via-edge tune) on this machine.")
CTX = typer.Option(4096, help="Context window (tokens).")
THREADS = typer.Option(None, help="CPU threads (default: all cores).")
GPU_LAYERS = typer.Option(-1, help="Layers to offload to Metal/GPU (-1: all; CPU builds ignore it).")
FLASH_ATTN = typer.Option(None, "--flash-attn/--no-flash-attn", help="Default: auto.")
EXACT_OPT = typer.Option(False, "--exact", help="No weight repacking: verification batches of up to 7 tokens then "
                         "compute exactly what single decodes do, so greedy sd (n_draft <= 6) equals ar (slower).")
KV_TYPE = typer.Option("f16", help="KV cache type: f16, f32 or q8_0.")
VERBOSE = typer.Option(False, "--verbose", "-v", help="Show llama.cpp's log.")


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt (a user message unless --raw)."),
    mode: Optional[str] = typer.Option(None, help=f"Decoding mode: {', '.join(ENGINE_MODES)} [default: tuned, else ar].",
                                       show_default=False),
    pair: Optional[str] = PAIR,
    target: Optional[str] = TARGET,
    draft: Optional[str] = DRAFT,
    slim: Optional[str] = SLIM,
    draft_layers: Optional[str] = DRAFT_LAYERS,
    slim_layers: Optional[str] = SLIM_LAYERS,
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Maximum new tokens."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_k: int = typer.Option(0, help="0 = off."),
    top_p: float = typer.Option(1.0),
    min_p: float = typer.Option(0.0),
    seed: Optional[int] = typer.Option(None, help="Seed for reproducible sampling."),
    stop: List[str] = typer.Option([], help="Stop string (repeatable)."),
    raw: bool = typer.Option(False, help="Do not apply the chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with text, stats and timings."),
    n_draft: Optional[int] = N_DRAFT,
    p_min: Optional[float] = P_MIN,
    n_min: Optional[int] = N_MIN,
    tau_accept: Optional[float] = TAU_ACCEPT,
    tau_full: Optional[float] = TAU_FULL,
    route: Optional[str] = ROUTE,
    max_lag: Optional[int] = MAX_LAG,
    hier_block: Optional[int] = HIER_BLOCK,
    untuned: bool = UNTUNED,
    ctx: int = CTX,
    threads: Optional[int] = THREADS,
    gpu_layers: int = GPU_LAYERS,
    flash_attn: Optional[bool] = FLASH_ATTN,
    exact: bool = EXACT_OPT,
    kv_type: str = KV_TYPE,
    verbose: bool = VERBOSE,
) -> None:
    """Generate text for PROMPT with the target alone (ar) or speculatively (sd, via, hier, lookup)."""
    _logging(verbose)
    opts = ModelOptions.from_args(locals())
    with opts.engine() as engine:
        mode = engine.mode
        stream = engine.stream(prompt, max_tokens=max_tokens, stop=stop, mode=mode, temperature=temperature,
                               top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, chat_template=not raw)
        for piece in stream:
            if not as_json:
                sys.stdout.write(piece.text)
                sys.stdout.flush()
        res = engine.last_result
        s = res.stats
        if as_json:
            out = res.to_dict()
            out["models"] = {role: str(m.path) for role, m in vars(engine.models).items()
                             if hasattr(m, "path")}
            out["timings"] = {
                "prompt_n": s.prompt_tokens, "prompt_ms": round(s.prefill_seconds * 1e3, 2),
                "prompt_per_second": round(s.prompt_tokens_per_second, 2),
                "predicted_n": s.generated_tokens, "predicted_ms": round(s.generate_seconds * 1e3, 2),
                "predicted_per_second": round(s.tokens_per_second, 2),
                "draft_n": s.draft_n, "draft_n_accepted": s.draft_n_accepted,
            }
            typer.echo(json.dumps(out, indent=2))
        else:
            sys.stdout.write("\n")
            _err(f"[{mode}] {s.generated_tokens} tokens, {s.tokens_per_second:.1f} tok/s "
                 f"(prompt {s.prompt_tokens} tokens, {s.prompt_tokens_per_second:.0f} tok/s)"
                 + (f", accepted {s.draft_n_accepted}/{s.draft_n} drafted" if s.draft_n else "")
                 + (f", tiers A/B/C {s.tier_a}/{s.tier_b}/{s.tier_c}" if mode == "via" else ""))


@app.command()
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
    exact: bool = typer.Option(False, help="Exact kernels (see generate --exact): lossless modes match ar."),
    tuned: bool = typer.Option(False, "--tuned", help="Also run every mode with the pair's tuned knobs and slim "
                               "(via-edge tune), as <mode>:tuned beside the defaults, interleaved."),
    compare: Optional[Tuple[Path, Path]] = typer.Option(None, help="Diff two results files instead of running."),
    n_draft: int = typer.Option(6),
    p_min: float = typer.Option(0.0),
    tau_accept: float = typer.Option(0.9),
    tau_full: float = typer.Option(0.3),
    route: str = typer.Option("slim"),
    max_lag: int = typer.Option(32),
    hier_block: int = typer.Option(12),
    ctx: int = typer.Option(4096),
    threads: Optional[int] = typer.Option(None),
) -> None:
    """Measure speed and fidelity of every mode side by side, interleaved on the same prompts."""
    from . import bench as B

    _logging(False)
    if compare:
        typer.echo(B.compare(B.load_results(compare[0]), B.load_results(compare[1])))
        return
    cfg = B.BenchConfig(pair=pair, modes=[m.strip() for m in modes.split(",") if m.strip()], peers=peers,
                        suite=suite, categories=[c.strip() for c in categories.split(",")] if categories else None,
                        per_category=per_category, max_tokens=max_tokens, exact=exact, n_ctx=ctx,
                        threads=threads, tuned=tuned, quick=quick, command="via-edge " + " ".join(sys.argv[1:]),
                        spec=SpecParams(n_draft=n_draft, tau_accept=tau_accept, tau_full=tau_full, route=route,
                                        max_lag=max_lag, hier_block=hier_block, p_min=p_min))
    if quick:
        cfg.pair = pair or B.QUICK["pair"]
        cfg.categories = cfg.categories or B.QUICK["categories"]
        cfg.max_tokens = B.QUICK["max_tokens"] if max_tokens == 128 else max_tokens
        cfg.exact = cfg.f32 = True  # quantized kernels differ between batch and single: see build_f32
    results = B.run_bench(cfg)
    for path in B.write_outputs(results, out):
        typer.echo(str(path))
    summary = results["summary"]
    for method, s in summary.items():
        typer.echo(f"  {method:24s} {s['tok_s']['median']:7.1f} tok/s  speedup {s['speedup']:.2f}x  "
                   f"agreement {s['fidelity']['agreement_mean']:.2f}")


@app.command()
def chat(
    mode: Optional[str] = typer.Option(None, help=f"Decoding mode: {', '.join(ENGINE_MODES)} [default: tuned, else sd].",
                                       show_default=False),
    system: Optional[str] = typer.Option(None, help="System message."),
    show_tiers: bool = typer.Option(False, help="Colour each token by origin: green draft, yellow slim, blue target."),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="Maximum tokens per answer."),
    temperature: float = typer.Option(0.0),
    seed: Optional[int] = typer.Option(None),
    pair: Optional[str] = PAIR, target: Optional[str] = TARGET, draft: Optional[str] = DRAFT,
    slim: Optional[str] = SLIM, draft_layers: Optional[str] = DRAFT_LAYERS, slim_layers: Optional[str] = SLIM_LAYERS,
    n_draft: Optional[int] = N_DRAFT, p_min: Optional[float] = P_MIN, n_min: Optional[int] = N_MIN,
    tau_accept: Optional[float] = TAU_ACCEPT, tau_full: Optional[float] = TAU_FULL, route: Optional[str] = ROUTE,
    max_lag: Optional[int] = MAX_LAG, hier_block: Optional[int] = HIER_BLOCK, untuned: bool = UNTUNED,
    ctx: int = CTX, threads: Optional[int] = THREADS, gpu_layers: int = GPU_LAYERS,
    flash_attn: Optional[bool] = FLASH_ATTN, exact: bool = EXACT_OPT, kv_type: str = KV_TYPE,
    verbose: bool = VERBOSE,
) -> None:
    """Chat in the terminal, streaming, multi-turn (/help inside lists the commands)."""
    from .chat import run

    _logging(verbose)
    opts = ModelOptions.from_args(locals(), fallback_mode="sd")
    with opts.engine(progress=True) as engine:
        _tuning_hint(engine, target)
        run(engine, system=system, max_tokens=max_tokens, show_tiers=show_tiers, temperature=temperature,
            seed=seed)


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to listen on (loopback by default)."),
    port: int = typer.Option(8080),
    mode: Optional[str] = typer.Option(None, help=f"Default decoding mode: {', '.join(ENGINE_MODES)}; requests may "
                                       "set 'mode' [default: tuned, else sd].", show_default=False),
    max_body: int = typer.Option(1 << 20, help="Largest request body in bytes."),
    max_tokens_limit: int = typer.Option(4096, help="Largest max_tokens a request may ask for."),
    pair: Optional[str] = PAIR, target: Optional[str] = TARGET, draft: Optional[str] = DRAFT,
    slim: Optional[str] = SLIM, draft_layers: Optional[str] = DRAFT_LAYERS, slim_layers: Optional[str] = SLIM_LAYERS,
    n_draft: Optional[int] = N_DRAFT, p_min: Optional[float] = P_MIN, n_min: Optional[int] = N_MIN,
    tau_accept: Optional[float] = TAU_ACCEPT, tau_full: Optional[float] = TAU_FULL, route: Optional[str] = ROUTE,
    max_lag: Optional[int] = MAX_LAG, hier_block: Optional[int] = HIER_BLOCK, untuned: bool = UNTUNED,
    ctx: int = CTX, threads: Optional[int] = THREADS, gpu_layers: int = GPU_LAYERS,
    flash_attn: Optional[bool] = FLASH_ATTN, exact: bool = EXACT_OPT, kv_type: str = KV_TYPE,
    verbose: bool = VERBOSE,
) -> None:
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models, /health)."""
    from .server import run

    _logging(verbose)
    opts = ModelOptions.from_args(locals(), fallback_mode="sd")
    with opts.engine(progress=True) as engine:
        _tuning_hint(engine, target)
        mode = engine.mode
        _err(f"via-edge serving {engine.model_name} ({mode}) on http://{host}:{port}/v1")
        run(engine, host, port, max_body=max_body, max_tokens_limit=max_tokens_limit)


@app.command()
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
    ctx: int = CTX,
    threads: Optional[int] = THREADS,
    out: Optional[Path] = typer.Option(None, help="Also write report.md, tune.json and frontier.png here."),
) -> None:
    """Measure this machine, search the slim verifier, predict every configuration offline, check the
    prediction with a real run, and store the choice generate, chat, serve and the API then use."""
    from .tune.report import write_outputs
    from .tune.tuner import TuneConfig, tune as run_tune

    _logging(False)
    for name, value, lo in (("--search-evals", search_evals, 1), ("--calib-tokens", calib_tokens, 2),
                            ("--heldout", heldout, 1), ("--verify-tokens", verify_tokens, 2), ("--repeats", repeats, 1)):
        if value < lo:
            raise ViaEdgeError(f"{name} must be at least {lo}, got {value}")
    cfg = TuneConfig(pair=pair, fidelity_floor=fidelity_floor, slim_budget=slim_budget, search_evals=search_evals,
                     calib_tokens=calib_tokens, heldout=heldout, verify_tokens=verify_tokens, repeats=repeats,
                     n_ctx=ctx, threads=threads)
    result = run_tune(cfg)
    paths = write_outputs(result, out)
    typer.echo(result["choice"]["summary"])
    for p in [result["paths"]["profile"], result["paths"]["choice"], *map(str, paths)]:
        typer.echo(f"  wrote {p}")


# ---- models ----------------------------------------------------------------------------------------
@models_app.command("list")
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


@models_app.command("pull")
def models_pull(name: str = typer.Argument(..., help="Model or pair name.")) -> None:
    """Fetch a model (or both models of a pair), verify its SHA-256 and put it in place."""
    path = catalog.pull(name)
    typer.echo(str(path))


@models_app.command("path")
def models_path(name: str) -> None:
    """Print the file of a present model (exit 2 if it is not downloaded)."""
    typer.echo(str(catalog.resolve(name)))


@models_app.command("verify")
def models_verify(name: str) -> None:
    """Recompute a present model's SHA-256 against the catalog."""
    if not catalog.verify(name):
        raise ViaEdgeError(f"{name}: SHA-256 does not match the catalog; delete it and pull again")
    typer.echo(f"{name}: ok")


# ---- slim ------------------------------------------------------------------------------------------
@slim_app.command("build")
def slim_build(
    target: str = typer.Argument(..., help="Target GGUF path or catalog name."),
    layers: str = typer.Option(..., help="Blocks to keep, e.g. 0-20 or 0-3,14-27."),
    out: Optional[Path] = typer.Option(None, help="Output path (default: next to the target)."),
) -> None:
    """Write the derived GGUF of TARGET's chosen blocks (reused when present)."""
    from .slim import build_slim

    typer.echo(str(build_slim(catalog.resolve(target, pull_missing=True), layers, out)))


def _tuning_hint(engine: Engine, target: Optional[str]) -> None:
    if engine.tuned is None and not target:
        _err(f"note: no tuned choice for this pair on this machine, so mode {engine.mode} with default knobs; "
             "`via-edge tune` measures which mode is fastest here")


_shown: dict[str, int] = {}


def _load_progress(role: str, frac: float) -> None:
    """One line per model, rewritten only when the whole percentage changes."""
    pct = int(frac * 100)
    if _shown.get(role) == pct:
        return
    _shown[role] = pct
    sys.stderr.write(f"\rloading {role} model {pct:3d}%" + ("\n" if pct >= 100 else ""))
    sys.stderr.flush()


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
        _err("interrupted")
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
