"""The automatic weight format: the machine's fastest quality-checked format with no tuning step.

A shipped file is rarely in the format this CPU's kernels run fastest (formats.py), and a new
user will not run `via-edge tune` before the first question. So the first time a model is used
on a machine and llama.cpp build, the format step runs once: derive the formats this build
favours, time a one-token decode in each against the shipped file and measure how far each
departs from it (quality.py), then keep the fastest that clears the gate and is at least
MIN_SPEEDUP faster, else the shipped file. The choice is stored per (model SHA-256, machine,
build) and reused at once afterwards; a lock file makes a second process wait instead of
deriving twice, and the variant itself is written all or nothing (formats.derive).
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Iterator, Sequence

from ..errors import InvalidParameterError, ViaEdgeError
from ..files import read_json, write_json
from ..llama import LoadParams, system_info
from ..machine import build, cpu_name, machine_key
from ..progress import StatusLine
from . import formats
from .catalog import model_dir, sha256_cached

AUTO = "auto"
ENV = "VIA_EDGE_FORMAT"
MIN_SPEEDUP = 1.15  # below this at one token a user-invisible lossy change does not pay
# The gate (docs/design.md, "The automatic format"): teacher-forced top-1 agreement with the
# shipped file and its perplexity ratio on a fixed text. The target's 4-bit variants keep
# 0.938-0.972 and x1.01-1.08 (docs/benchmarks.md, section 14); the task-accuracy suite
# (`via-edge bench --suite humaneval`) found no pass@1 difference at that level (section 33).
GATE_AGREEMENT = 0.90
GATE_PPL_RATIO = 1.10
# One-token decode timings per format (medians). A timing's estimate of a format's gain moves from one run
# to the next (where the files' memory landed, a busy moment): 1.02-1.23x over 16 runs of 5 repeats and
# 1.04-1.15x over 24 of 15 for a `q4_0` that gains 1.03-1.08x over whole answers (docs/benchmarks.md section
# 81), so a derived format that clears the speed-up is timed again, both files loaded afresh, and taken only
# if the second timing agrees.
REPEATS = 15


@dataclass
class Candidate:
    """One measured format: its one-token cost and its quality against the shipped file."""

    format: str
    ms: float                 # median seconds x 1e3 of a one-token decode at the survey context
    size: int
    agreement: float = 1.0
    ppl_ratio: float = 1.0
    verdict: str = ""         # "chosen", "kept: shipped", or why it was not taken
    again: float | None = None  # the speed-up over the shipped file when timed again (only if it cleared the first)


@dataclass
class FormatChoice:
    """What the format step chose for one model file on this machine and build, and why."""

    format: str
    source: str
    sha256: str
    machine: str
    reason: str
    candidates: list[Candidate] = field(default_factory=list)
    seconds: float = 0.0
    date: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "FormatChoice":
        known = {f.name for f in fields(cls)}
        out = cls(**{k: v for k, v in data.items() if k in known})
        out.candidates = [Candidate(**c) for c in out.candidates]
        return out


def requested(given: str | None, explicit_path: bool) -> str:
    """The format asked for: `given`, else VIA_EDGE_FORMAT, else `auto` for a catalog model and
    `shipped` for a GGUF path (a file the user named is used as given unless auto is asked for)."""
    name = given or os.environ.get(ENV) or (formats.SHIPPED if explicit_path else AUTO)
    check_name(name, "--format" if given else ENV)
    return name


def check_name(name: str, where: str) -> None:
    """`name` is auto, shipped or a recipe; else one message naming `where` it came from."""
    if name != AUTO and name not in formats.FORMAT_NAMES:
        raise InvalidParameterError(f"{where} must be auto, shipped or one of {', '.join(formats.RECIPES)}; "
                                    f"got '{name}'")


def candidates() -> tuple[str, ...]:
    """The formats the step tries on this build: each must derive in about a minute for a 1.5B
    model, so IQ4_NL (minutes of search per file) is left to `via-edge tune`."""
    return ("q4_0",)


def kernel_note() -> str:
    """Why a format can be faster here, in a clause (for the first-use paragraph)."""
    info = system_info()
    if "AMX_INT8 = 1" in info:
        return "this build's AMX kernels run Q4_0 weights on the CPU's int8 tiles"
    if "AVX2 = 1" in info or "NEON = 1" in info:
        return ("llama.cpp repacks Q4_0 weights for this CPU's SIMD kernels, while the Q6_K tensors a "
                "Q4_K_M file keeps take a slower per-token loop")
    return "llama.cpp's kernels differ in speed by weight type"


def choice_path(sha: str) -> Path:
    return model_dir() / "formats" / f"{sha[:16]}--{machine_key()}.json"


def _read(path: Path) -> FormatChoice | None:
    """A stored choice, or None when missing or unreadable (then measured again and overwritten)."""
    try:
        return FormatChoice.from_dict(read_json(path)) if path.exists() else None
    except (ViaEdgeError, TypeError):
        return None


def stored(sha: str) -> FormatChoice | None:
    return _read(choice_path(sha))


def all_stored() -> list[FormatChoice]:
    """Every stored choice for this machine and build (`via-edge info`, `models list`)."""
    found = (_read(p) for p in sorted((model_dir() / "formats").glob(f"*--{machine_key()}.json")))
    return [c for c in found if c is not None]


def resolve(source: Path, name: str, load: LoadParams, *, quiet: bool = False,
            say: Callable[[str], None] | None = None, min_speedup: float = MIN_SPEEDUP,
            names: Sequence[str] | None = None) -> tuple[Path, str]:
    """(the file to load, its format name) for `source` in format `name` (shipped, auto or a
    recipe). Auto measures once per model, machine and build (`names`: the candidates, default
    `candidates()`); a failed step keeps the shipped file."""
    say = say or (lambda m: None if quiet else print(m, file=sys.stderr, flush=True))
    if name == formats.SHIPPED:
        return source, name
    if name != AUTO:
        return formats.derive(source, name, quiet=quiet, threads=load.n_threads), name
    sha = sha256_cached(source)
    choice = stored(sha)
    if choice is None:
        with _lock(sha, source, say):
            choice = stored(sha)  # another process may have chosen while this one waited
            if choice is None:
                try:
                    choice = choose(source, sha, load, names=names, quiet=quiet, say=say, min_speedup=min_speedup)
                except ViaEdgeError as exc:
                    say(f"format step failed, so the shipped file is used: {exc}")
                    return source, formats.SHIPPED
    if choice.format == formats.SHIPPED:
        return source, formats.SHIPPED
    try:  # the variant is re-derived if it was deleted (`models rm`)
        return formats.derive(source, choice.format, quiet=quiet, threads=load.n_threads), choice.format
    except ViaEdgeError as exc:
        say(f"the automatic format {choice.format} could not be derived again, so the shipped file is used: {exc}")
        return source, formats.SHIPPED


@contextmanager
def _lock(sha: str, source: Path, say: Callable[[str], None]) -> Iterator[None]:
    """One format step per model at a time across processes; the kernel drops the lock when its
    holder dies, so a killed step never blocks the next."""
    path = choice_path(sha).with_suffix(".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as exc:
        raise ViaEdgeError(f"cannot create {path} ({exc.strerror}); set VIA_EDGE_MODEL_DIR to a writable "
                           "directory or use --format shipped") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"another via-edge process is choosing the weight format of {source.name}; waiting for it")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def choose(source: Path, sha: str, load: LoadParams, *, names: Sequence[str] | None = None, quiet: bool = False,
           say: Callable[[str], None] = print, min_speedup: float = MIN_SPEEDUP) -> FormatChoice:
    """Run the format step on `source` and store its choice (nothing is stored if it is
    interrupted or fails, so the next use runs it again)."""
    from ..llama import LlamaModel
    from ..tune.survey import FORMAT_PROMPTS, FORMAT_TOKENS, format_prompts, survey

    names = tuple(names or candidates())
    sizes = {n: formats.estimate_size(source, formats.recipe(n)) for n in names}
    say(f"First use of {source.name} on this machine ({cpu_name()}, {build()['flavor']} build): {kernel_note()}, "
        f"so via-edge checks once whether {' or '.join(names)} answers like the shipped file and decodes faster. "
        f"It derives {' and '.join(f'{n} (~{sizes[n] / 1e9:.1f} GB)' for n in names)} next to the model, "
        f"times one-token decoding (twice for a format it would take) and compares {FORMAT_PROMPTS * FORMAT_TOKENS} "
        "answer tokens and a perplexity text with the shipped file: a few minutes, once; the choice is then "
        f"reused. `--format shipped` (or {ENV}=shipped) skips it.")
    t0 = time.monotonic()
    with LlamaModel(source, load) as m:
        prompts = format_prompts(m)
    lines: dict[str, StatusLine] = {}

    def progress(stage: str, frac: float) -> None:
        lines.setdefault(stage, StatusLine(quiet)).show(frac, f"format step: {stage} {int(frac * 100):3d}%")

    def timed(which: Sequence[str], note: str = "") -> list:
        return survey({"target": source}, which, prompts, load, continuation=FORMAT_TOKENS, repeats=REPEATS,
                      batches=(1,), quiet=quiet, progress=lambda stage, f: progress(stage + note, f))["target"]

    found = [Candidate(r.format, r.cost[1] * 1e3, r.size, r.quality.agreement if r.quality else 1.0,
                       r.quality.ppl_ratio if r.quality else 1.0) for r in timed(names)]
    shipped_ms = found[0].ms
    best = _pick(found, shipped_ms, min_speedup)
    while best is not found[0] and best.again is None:  # a lossy choice the user did not ask for: time it again
        again = timed([best.format], f" ({best.format} again, files loaded afresh)")
        best.again = again[0].cost[1] / again[1].cost[1]
        if best.again < min_speedup:
            best.verdict = (f"{shipped_ms / best.ms:.3f}x at one token, then {best.again:.3f}x timed again "
                            f"< {min_speedup}x")
        best = _pick(found, shipped_ms, min_speedup)
    choice = FormatChoice(best.format, source.name, sha, machine_key(), _reason(best, found), found,
                          time.monotonic() - t0, _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    write_json(choice_path(sha), choice.to_dict())
    say(f"format step done in {choice.seconds:.0f} s: {choice.reason}. Stored in {choice_path(sha)}.")
    return choice


def _pick(found: list[Candidate], shipped_ms: float, min_speedup: float) -> Candidate:
    """The fastest candidate that clears the gate and the speed-up (in its second timing too, if
    it had one); the shipped file otherwise."""
    found[0].verdict = ""
    for c in found[1:]:
        if c.again is not None and c.again < min_speedup:
            continue  # its verdict says both timings
        c.verdict = ""
        if c.agreement < GATE_AGREEMENT:
            c.verdict = f"agreement {c.agreement:.3f} < {GATE_AGREEMENT}"
        elif c.ppl_ratio > GATE_PPL_RATIO:
            c.verdict = f"perplexity x{c.ppl_ratio:.3f} > x{GATE_PPL_RATIO}"
        elif shipped_ms / c.ms < min_speedup:
            c.verdict = f"{shipped_ms / c.ms:.3f}x at one token < {min_speedup}x"
    ok = [c for c in found[1:] if not c.verdict]
    best = min(ok, key=lambda c: c.ms) if ok else found[0]
    best.verdict = "chosen"
    return best


def _reason(best: Candidate, found: list[Candidate]) -> str:
    shipped = found[0]
    if best is shipped:
        why = "; ".join(f"{c.format}: {c.verdict}" for c in found[1:])
        return f"keeping the shipped file ({shipped.ms:.1f} ms per token; {why})"
    again = f"; {best.again:.2f}x timed again" if best.again is not None else ""
    return (f"using {best.format}: one token in {best.ms:.1f} ms against {shipped.ms:.1f} ms for the shipped file "
            f"({shipped.ms / best.ms:.2f}x{again}), agreement {best.agreement:.3f}, perplexity x{best.ppl_ratio:.3f}, "
            f"{best.size / 1e9:.2f} GB on disk")
