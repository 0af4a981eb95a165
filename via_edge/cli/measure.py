"""The commands that measure: bench (modes side by side, or the server under load) and tune."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional, Tuple

import typer

from ..batching import DEFAULT_PARALLEL
from ..decode.constraints import grammar_text
from ..decode.memory import DEFAULT_TOKENS
from ..decode.modes import MODE_NAMES
from ..decode.spec import SpecParams
from ..errors import ViaEdgeError
from ..files import write_text
from ..llama import MAX_SEQ
from ..tune.choose import SCREEN_FLOOR
from ..tune.survey import QUALITY_FLOOR, check_floor
from .app import app
from .models import format_names
from .options import SPEC_OPTS, Options, check_range, doing, err, remote, shared


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
    from ..bench import load as L
    from ..bench.suite import prompts_in_turn

    counts = _counts("clients", clients, 1, 256)
    slots = _counts("parallel", parallel, 1, MAX_SEQ)
    check_range("requests", requests, 1, 100000)
    check_range("repeats", repeats, 1, 1000)
    if mode is not None and mode not in MODE_NAMES:
        raise ViaEdgeError(f"--modes for --serve takes one mode ({', '.join(MODE_NAMES)}), got {mode!r}")
    cats = [c.strip() for c in categories.split(",")] if categories else None
    prompts = prompts_in_turn(suite, cats, requests)
    args = (["--pair", pair] if pair else []) + (["--threads", str(threads)] if threads else []) \
        + (["--mode", mode] if mode else [])
    cfg = L.LoadConfig(prompts, counts, slots, max_tokens=max_tokens, repeats=repeats, server_args=args,
                       command="via-edge " + " ".join(sys.argv[1:]))
    doing("the load benchmark", f"nothing was written to {out}")
    results = L.run_load(cfg, log=err)
    for path in L.write_load(results, out):
        typer.echo(str(path))
    for row in results["summary"]:
        typer.echo(f"  {row['server']:14s} {row['clients']:3d} clients {row['tok_s']:7.1f} tok/s  "
                   f"{row['ratio']:.2f}x one-at-a-time  p50 {row['latency_p50']:.2f} s  TTFT p50 {row['ttft_p50']:.2f} s")


def _response_format(path: Path | None) -> dict | None:
    """--response-format's file: a response_format object as is, a bare schema wrapped as json_schema."""
    if path is None:
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ViaEdgeError(f"cannot read --response-format {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ViaEdgeError(f"--response-format {path} must hold a JSON object")
    fmt = data if data.get("type") in ("json_object", "json_schema") else \
        {"type": "json_schema", "json_schema": {"name": path.stem, "schema": data}}
    grammar_text(None, fmt)  # a schema the converter cannot take fails here, before models load
    return fmt


@app.command()
@shared(SPEC_OPTS)
def bench(
    pair: Optional[str] = typer.Option(None, help="Catalog pair (default: qwen2.5-coder)."),
    modes: str = typer.Option("ar,sd,via,hier,lookup", help="Comma-separated modes; must include ar. MODE@FORMAT "
                              "runs a mode on another weight format (e.g. ar@shipped), as does PEER@FORMAT; "
                              "MODE:predicted sends each row's prediction (edit suite: the file), "
                              "MODE:nomemory runs without the copy memory."),
    weight_format: Optional[str] = typer.Option(None, "--format", help="The target's weight format for the modes "
                                                "and peers: auto (default), shipped, or a recipe (q4_0, ...)."),
    suite: str = typer.Option("spec-bench", help="spec-bench, edit, humaneval, or a JSONL file with 'prompt', "
                              "'turns' or 'requests' (comma-separated to combine)."),
    copy_memory: int = typer.Option(DEFAULT_TOKENS, help="Each method's copy memory across the run, in tokens "
                                    "(0: off)."),
    categories: Optional[str] = typer.Option(None, help="Comma-separated categories (default: all)."),
    per_category: int = typer.Option(1, help="Prompts per category (the first ones, in file order)."),
    rounds: int = typer.Option(1, help="Runs of every method on every prompt, the order changed each round; "
                               "ratios pair the runs of one round (repeats for a noisy machine)."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n"),
    out: Path = typer.Option(Path("bench-out"), help="Folder for results.json, report.md, speedup.png."),
    quick: bool = typer.Option(False, help="SmolLM2-135M (F32 copy, exact kernels) with a slim of itself "
                               "as draft, 4 prompts: about two minutes on 2 cores."),
    peers: bool = typer.Option(True, "--peers/--no-peers", help="Also measure llama-cpp-python's Llama."),
    peer: Optional[List[str]] = typer.Option(None, help="Only these peers (repeatable): llama-cpp-python, "
                                             "llama-cpp-python-lookup (the default two), llama-server, "
                                             "llama-server-ngram, llama-server-ngram-simple (llama.cpp's own "
                                             "server, plain, --spec-default and --spec-type ngram-simple; built "
                                             "by tools/build_llama_server.sh)."),
    peer_python: Optional[str] = typer.Option(None, help="Run the peers with this Python, e.g. an environment "
                                              "holding another llama.cpp build (docs/benchmarks.md, section 19)."),
    exact: bool = typer.Option(False, help="Exact kernels (see generate --exact): lossless modes match ar."),
    tuned: bool = typer.Option(False, "--tuned", help="Also run every mode with the pair's tuned knobs and slim "
                               "(via-edge tune), as <mode>:tuned beside the defaults, interleaved."),
    response_format: Optional[Path] = typer.Option(None, help="Also run every mode constrained to this JSON file: "
                                                   "an OpenAI response_format object or a bare JSON schema, as "
                                                   "<mode>:json beside the free runs, interleaved."),
    rpc: Optional[str] = typer.Option(None, help="RPC servers (HOST:PORT,...) holding a share of the target's "
                                      "layers, as for generate (the peers stay local)."),
    tensor_split: Optional[str] = typer.Option(None, help="With --rpc: layer shares, this machine's first."),
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
    from .. import bench as B

    check_range("ctx", ctx, 16, 1 << 20)
    check_range("threads", threads, 1, 1024)
    check_range("copy_memory", copy_memory, 0, 1 << 24)
    if compare:
        typer.echo(B.compare(B.load_results(compare[0]), B.load_results(compare[1])))
        return
    if serve:
        _bench_serve(pair, suite, categories, max_tokens, out, threads, clients, parallel_list, requests, repeats,
                     modes if modes != "ar,sd,via,hier,lookup" else None)
        return
    cfg = B.BenchConfig(pair=pair, modes=[m.strip() for m in modes.split(",") if m.strip()],
                        peers=(list(peer) if peer else list(B.DEFAULT_PEERS)) if peers else [], peer_python=peer_python,
                        suite=suite, categories=[c.strip() for c in categories.split(",")] if categories else None,
                        per_category=per_category, max_tokens=max_tokens, exact=exact, n_ctx=ctx,
                        threads=threads, tuned=tuned, quick=quick, command="via-edge " + " ".join(sys.argv[1:]),
                        response_format=_response_format(response_format), remote=remote(rpc, tensor_split),
                        spec=SpecParams(**opts.spec_overrides()), format=weight_format, copy_memory=copy_memory,
                        rounds=rounds)
    if quick:
        cfg.pair = pair or B.QUICK["pair"]
        cfg.categories = cfg.categories or B.QUICK["categories"]
        cfg.max_tokens = B.QUICK["max_tokens"] if max_tokens == 128 else max_tokens
        cfg.exact = cfg.f32 = True  # quantized kernels differ between batch and single: see build_f32
    doing("the benchmark", f"nothing was written to {out}")
    try:
        results = B.run_bench(cfg)
    except KeyboardInterrupt as exc:
        partial = getattr(exc, "partial", None)
        if partial is not None:
            path = write_text(out / "results.partial.json", json.dumps(partial, indent=1))
            doing("the benchmark", f"the {len(partial['meta']['prompts'])} prompts every method had finished "
                   f"are kept in {path}")
        raise
    for path in B.write_outputs(results, out):
        typer.echo(str(path))
    for method, s in results["summary"].items():
        typer.echo(f"  {method:24s} {s['tok_s']['median']:7.1f} tok/s  speedup {s['speedup']:.2f}x  "
                   f"agreement {s['fidelity']['agreement_mean']:.2f}")



@app.command()
@shared()
def tune(
    pair: Optional[str] = typer.Option(None, help="Catalog pair (default: qwen2.5-coder)."),
    fidelity_floor: float = typer.Option(0.95, help="Lossy modes (via) must keep at least this predicted "
                                         "token agreement with the target's greedy output."),
    slim_budget: float = typer.Option(0.75, help="A slim may cost at most this share of the target's "
                                      "verification call."),
    search_evals: int = typer.Option(8, help="Slims the layer search may build and score."),
    screen_floor: float = typer.Option(SCREEN_FLOOR, help="Slim modes whose best configuration on the search's "
                                       "prompts is predicted below this multiple of ar are dropped before their "
                                       "finalists are scored on every prompt (0: never dropped)."),
    calib_tokens: int = typer.Option(48, help="Target tokens recorded per calibration prompt."),
    heldout: int = typer.Option(4, help="Held-out prompts for the real check of the prediction."),
    verify_tokens: int = typer.Option(48, help="Tokens per held-out prompt in the real check."),
    repeats: int = typer.Option(2, help="Repeats of each cost measurement (medians kept)."),
    ctx: int = typer.Option(4096, help="Context window (tokens)."),
    threads: Optional[int] = typer.Option(None, help="CPU threads (default: all cores)."),
    formats_list: Optional[str] = typer.Option(None, "--formats", help="Weight formats to try for target and draft "
                                               "(comma-separated; 'shipped' alone skips the format step; default: "
                                               "shipped and the automatic format's candidates, already measured on "
                                               "first use; `models optimize --help` lists this build's wider set)."),
    quality_floor: float = typer.Option(QUALITY_FLOOR, help="A derived format must keep at least this teacher-forced "
                                        "top-1 agreement with the shipped file (0..1)."),
    out: Optional[Path] = typer.Option(None, help="Also write report.md, tune.json and frontier.png here."),
    replace: bool = typer.Option(False, "--replace", help="Replace a stored choice even when it was made over "
                                 "formats this run does not try."),
) -> None:
    """Measure this machine, try faster weight formats, search the slim verifier, predict every
    configuration offline, check the prediction with a real run, and store the choice generate,
    chat, serve and the API then use."""
    from ..tune.report import write_outputs
    from ..tune.tuner import TuneConfig, default_formats
    from ..tune.tuner import tune as run_tune

    check_range("ctx", ctx, 16, 1 << 20)
    check_range("threads", threads, 1, 1024)
    names = format_names(formats_list) if formats_list else default_formats()
    check_floor(quality_floor)
    cfg = TuneConfig(pair=pair, fidelity_floor=fidelity_floor, slim_budget=slim_budget, search_evals=search_evals,
                     screen_floor=screen_floor,
                     calib_tokens=calib_tokens, heldout=heldout, verify_tokens=verify_tokens, repeats=repeats,
                     n_ctx=ctx, threads=threads, formats=names, quality_floor=quality_floor, replace=replace)
    doing("tuning", "the stored choice is unchanged")
    result = run_tune(cfg)
    paths = write_outputs(result, out)
    typer.echo(result["choice"]["summary"])
    for p in [result["paths"]["profile"], result["paths"]["choice"], *map(str, paths)]:
        typer.echo(f"  wrote {p}")

