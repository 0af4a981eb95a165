"""The options several commands share, declared once, and what every command does before it runs.

The `Opt` groups are added to each command's signature by `@shared(...)`, which hands them to
the command as one `Options` value, checks every numeric option's range and every sampling and
decoding value before anything loads, and turns Ctrl-C into one line saying what was kept. The
speculation knobs are made from `SpecParams`' fields, so a new knob needs no CLI change.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import ipaddress
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, get_type_hints

import typer

from ..decode.memory import DEFAULT_TOKENS
from ..decode.modes import DEFAULT_MODE, MODE_NAMES
from ..decode.sampling import SamplingParams
from ..decode.spec import SpecParams
from ..engine import Engine
from ..errors import ViaEdgeError
from ..llama import EXACT, MAX_SEQ, LoadParams
from ..progress import StatusLine
from ..weights.autoformat import requested
from ..weights.slim import parse_layers

# what Ctrl-C interrupts, said when it does (set by each command as it goes)
activity = {"doing": "the command", "kept": "nothing was written"}


def is_loopback(host: str) -> bool:
    """Does `host` reach this machine only?"""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def err(msg: str) -> None:
    typer.echo(msg, err=True)


def doing(what: str, kept: str = "nothing was written") -> None:
    activity.update(doing=what, kept=kept)


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
    Opt("format", Optional[str], None, "Weight format: auto (derive and measure once per machine the formats this "
        "CPU runs faster, use the best that keeps quality), shipped (the file as it is), or q4_0, iq4_nl, ... "
        "(default: tuned, else auto for catalog models, shipped for a GGUF path; VIA_EDGE_FORMAT).",
        show_default=False),
    Opt("untuned", bool, False, "Ignore the pair's tuned choice (via-edge tune) on this machine.", ("--untuned",)),
)
RUN_OPTS = (
    Opt("ctx", Optional[int], None, "Context window in tokens (default 4096; serve: the total over its --parallel "
        "slots, default 4096 per slot).", lo=16, hi=1 << 20),
    Opt("threads", Optional[int], None, "CPU threads (default: all cores).", lo=1, hi=1024),
    Opt("gpu_layers", int, -1, "Layers to offload to Metal/GPU (-1: all; CPU builds ignore it).", lo=-1, hi=100000),
    Opt("flash_attn", Optional[bool], None, "Flash attention. Default: whichever decodes the target faster here, "
        "measured once per model file (on with --exact; llama.cpp's default for files under 300 MB).", ("--flash-attn/--no-flash-attn",)),
    Opt("exact", bool, False, "No weight repacking: verification batches of up to 7 tokens then compute exactly "
        "what single decodes do, so greedy sd (n_draft <= 6) equals ar (slower).", ("--exact",)),
    Opt("kv_type", str, "f16", "KV cache type: f16, f32 or q8_0."),
    Opt("prefill_helper", Optional[bool], None, "Decode long prompts on a copy of the target loaded without weight "
        "repacking (for a derived format, possibly the shipped file it was made from), then hand its KV cache "
        "over (more memory; slots take turns on it). Default: where measured at least 1.15x faster here (an AMD "
        "EPYC: 1.4x).", ("--prefill-helper/--no-prefill-helper",)),
    Opt("rpc", Optional[str], None, "RPC servers (HOST:PORT,...; `via-edge rpc-serve` there) that hold a share of "
        "the target's layers; draft and slim stay here."),
    Opt("tensor_split", Optional[str], None, "With --rpc: the layer shares of this machine, then of each server "
        "(e.g. 1,2,2; default: by free memory)."),
    Opt("copy_memory", int, DEFAULT_TOKENS, "Tokens of recent answers and predictions that copy drafting reads "
        "in later requests (0: off).", lo=0, hi=1 << 24),
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

    def load(self, n_parallel: int = 1) -> LoadParams:
        """How the models load: `--exact` sets the kernels (llama.EXACT), a flash-attention flag wins."""
        v = self.values
        kernels = {**(EXACT if v["exact"] else {}), **({} if v["flash_attn"] is None else {"flash_attn": v["flash_attn"]})}
        return LoadParams(n_ctx=v["ctx"] or 4096 * n_parallel, n_threads=v["threads"], n_gpu_layers=v["gpu_layers"],
                          kv_type=v["kv_type"], prefill_helper=v["prefill_helper"], **kernels,
                          **remote(v["rpc"], v["tensor_split"]))

    def engine(self, mode: str | None, fallback_mode: str = DEFAULT_MODE, progress: bool = False,
               n_parallel: int = 1) -> Engine:
        """The engine these options describe: a pair (with its tuned choice) or explicit files.

        Knobs left unset come from the pair's tuned choice on this machine when there is one
        (`via-edge tune`), else from SpecParams' defaults.
        """
        v = self.values
        kw: dict[str, Any] = dict(load=self.load(n_parallel), n_parallel=n_parallel, pull_missing=True, format=v["format"],
                                  copy_memory=v["copy_memory"],
                                  progress=load_progress if progress else None)
        for key, value in (("draft_layers", v["draft_layers"]), ("slim_layers", v["slim_layers"]), ("mode", mode)):
            if value:
                kw[key] = value
        doing("loading the models", "nothing was written (a model download in progress keeps its partial file)")
        if v["target"]:
            kw.setdefault("mode", fallback_mode)
            return Engine(v["target"], v["draft"], v["slim"], spec=SpecParams(**self.spec_overrides()), **kw)
        if v["draft"] or v["slim"]:
            raise ViaEdgeError("--draft and --slim need --target (or use --pair)")
        return Engine.from_pair(v["pair"], tuned=not v["untuned"], overrides=self.spec_overrides(),
                                fallback_mode=fallback_mode, **kw)



def check_range(name: str, value: Any, lo: float | None, hi: float | None) -> None:
    if value is None or isinstance(value, bool):
        return
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        span = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ViaEdgeError(f"--{name.replace('_', '-')} must be {'in ' if hi is not None else ''}{span}, got {value}")


def check_values(opts: Options) -> None:
    """Sampling values, decoding knobs and layer sets, checked before any model loads."""
    v = opts.values
    if "temperature" in v:
        SamplingParams(**{k: x for k, x in opts.sampling().items() if x is not None})
    if any(k in v for k in SPEC_KNOBS):
        SpecParams(**opts.spec_overrides())
    for name in ("draft_layers", "slim_layers"):
        if v.get(name):
            parse_layers(v[name], None)
    if "format" in v:
        requested(v["format"], explicit_path=True)  # the name, or VIA_EDGE_FORMAT's
    if "rpc" in v:
        remote(v["rpc"], v["tensor_split"])


def remote(rpc: str | None, tensor_split: str | None) -> dict[str, tuple]:
    """LoadParams' fields for --rpc and --tensor-split, checked (no connection is made here)."""
    from ..llama.rpc import parse_endpoint

    if tensor_split and not rpc:
        raise ViaEdgeError("--tensor-split needs --rpc")
    if not rpc:
        return {}
    endpoints = tuple(e.strip() for e in rpc.split(",") if e.strip())
    for e in endpoints:
        parse_endpoint(e)
    out: dict[str, tuple] = {"rpc": endpoints}
    if tensor_split:
        try:
            out["tensor_split"] = tuple(float(x) for x in tensor_split.split(","))
        except ValueError:
            raise ViaEdgeError(f"--tensor-split takes comma-separated numbers, got {tensor_split!r}") from None
        if len(out["tensor_split"]) != len(endpoints) + 1:
            raise ViaEdgeError(f"--tensor-split takes {len(endpoints) + 1} shares (this machine's, then one per "
                               f"--rpc server), got {len(out['tensor_split'])}")
    return out


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
                check_range(o.name, kwargs.get(o.name), o.lo, o.hi)
            for name, (lo, hi) in RANGES.items():
                check_range(name, kwargs.get(name), lo, hi)
            values = {o.name: kwargs.pop(o.name) for o in opts}
            check_values(Options(values))
            setup_logging(bool(values.get("verbose")))
            if "opts" in sig.parameters:
                kwargs["opts"] = Options(values)
            try:
                return fn(**kwargs)
            except KeyboardInterrupt:  # here, not in main(): typer turns it into a silent exit 130
                err(f"\ninterrupted: {activity['doing']} stopped; {activity['kept']}")
                raise SystemExit(130) from None

        command.__signature__ = sig.replace(parameters=own + [o.parameter() for o in opts])
        command.__annotations__ = {**hints, **{o.name: o.type for o in opts}}
        return command

    return wrap


def mode_opt(fallback: str, what: str = "Decoding mode") -> Any:
    return typer.Option(None, help=f"{what}: {', '.join(MODE_NAMES)} (default: tuned, else {fallback}).",
                        show_default=False)



def tuning_hint(engine: Engine, target: Optional[str]) -> None:
    if engine.tuned is None and not target:
        err(f"note: no tuned choice for this pair on this machine, so mode {engine.mode} with default knobs; "
             "`via-edge tune` measures which mode is fastest here")


_loading: dict[str, StatusLine] = {}


def load_progress(role: str, frac: float) -> None:
    """One status line per model load; a finished line is dropped, so a later load of the same role shows too."""
    what = {"batch costs": "measuring the target's batch costs (once on this machine)",
            "prompt costs": "measuring prompts with and without weight repacking (once on this machine)",
            "attention": "measuring decoding with and without flash attention (once on this machine)",
            }.get(role, f"loading {role} model")
    _loading.setdefault(role, StatusLine()).show(frac, f"{what} {int(frac * 100):3d}%")
    if frac >= 1.0:
        del _loading[role]


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if verbose:
        logging.getLogger("via_edge").setLevel(logging.INFO)
        logging.getLogger("via_edge.llama").setLevel(logging.INFO)
