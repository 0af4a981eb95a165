"""The commands that run a model for a user: generate, chat, serve, and info about this machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from ..batching import DEFAULT_PARALLEL
from ..decode.modes import DEFAULT_MODE
from ..errors import ViaEdgeError
from ..weights import catalog
from .app import app
from .options import (
    MODEL_OPTS,
    RUN_OPTS,
    SAMPLING_OPTS,
    SPEC_OPTS,
    Options,
    doing,
    err,
    is_loopback,
    mode_opt,
    shared,
    tuning_hint,
)


@app.command()
@shared(MODEL_OPTS, SPEC_OPTS, SAMPLING_OPTS, RUN_OPTS)
def generate(
    prompt: Optional[str] = typer.Argument(None, help="The prompt (a user message unless --raw); - reads it "
                                           "from standard input.", show_default=False),
    prompt_file: Optional[Path] = typer.Option(None, help="Read the prompt from this file (long prompts)."),
    prediction_file: Optional[Path] = typer.Option(None, help="Text the answer will likely repeat (the file an "
                                                   "edit rewrites): drafted from, never shown to the model."),
    mode: Optional[str] = mode_opt(DEFAULT_MODE),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Maximum new tokens."),
    stop: List[str] = typer.Option([], help="Stop string (repeatable)."),
    raw: bool = typer.Option(False, help="Do not apply the chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with text, stats and timings."),
    opts: Options = None,
) -> None:
    """Generate text for PROMPT with the target alone (ar) or speculatively (sd, via, hier, lookup)."""
    from ..openai_api.responses import timings

    text = _read_prompt(prompt, prompt_file)
    prediction = _read_file(prediction_file, "--prediction-file") if prediction_file is not None else None
    with opts.engine(mode) as engine:
        doing("generation", "nothing was printed or written" if as_json else
              "the answer so far is above; nothing was written to disk")
        stream = engine.stream(text, max_tokens=max_tokens, stop=stop, mode=engine.mode, chat_template=not raw,
                               prediction=prediction, **opts.sampling())
        for piece in stream:
            if not as_json:
                sys.stdout.write(piece.text)
                sys.stdout.flush()
        res = stream.result
        s = res.stats
        if as_json:
            out = res.to_dict()
            out["format"] = engine.format
            out["prefill_helper"] = engine.target.prefiller is not None
            out["models"] = {role: str(m.path) for role in ("target", "draft", "slim")
                             if (m := getattr(engine.models, role)) is not None}
            out["timings"] = timings(res)
            typer.echo(json.dumps(out, indent=2))
        else:
            sys.stdout.write("\n")
            err(f"[{res.mode}, {engine.format}] {s.generated_tokens} tokens, {s.tokens_per_second:.1f} tok/s "
                 f"(prompt {s.prompt_tokens} tokens, {s.prompt_tokens_per_second:.0f} tok/s"
                 f"{' on the prefill helper' if s.target.helped else ''})"
                 + (f", accepted {s.draft_n_accepted}/{s.draft_n} drafted, {s.mean_accepted_per_round:.1f} per "
                    f"round, drafts of {s.mean_draft_length:.1f}" if s.draft_n else "")
                 + (f", {s.copied_tokens} copied, {s.generated_tokens - s.copied_tokens} generated"
                    if res.mode == "lookup" or prediction else "")
                 + (f", prediction: {s.prediction_draft_n_accepted}/{s.prediction_draft_n} drafted tokens kept, "
                    f"{s.prediction_accepted} of its {s.prediction_accepted + s.prediction_rejected} tokens "
                    "in the answer" if prediction else "")
                 + (f", tiers A/B/C {s.tier_a}/{s.tier_b}/{s.tier_c}" if res.mode == "via" else ""))


def _read_file(path: Path, option: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ViaEdgeError(f"cannot read {option} {path}: {exc}") from exc


def _read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if prompt is not None and prompt_file is not None:
        raise ViaEdgeError("give the prompt as an argument or with --prompt-file, not both")
    if prompt_file is not None:
        text = _read_file(prompt_file, "--prompt-file")
    elif prompt == "-":
        text = sys.stdin.read()
    elif prompt is None:
        raise ViaEdgeError("no prompt: give it as an argument, - for standard input, or --prompt-file PATH")
    else:
        text = prompt
    if not text.strip():
        raise ViaEdgeError("the prompt is empty")
    return text



@app.command()
@shared(MODEL_OPTS, SPEC_OPTS, SAMPLING_OPTS, RUN_OPTS)
def chat(
    mode: Optional[str] = mode_opt(DEFAULT_MODE),
    system: Optional[str] = typer.Option(None, help="System message."),
    show_tiers: bool = typer.Option(False, help="Colour each token by origin: green draft, cyan copied from the context, yellow slim, blue target."),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="Maximum tokens per answer."),
    opts: Options = None,
) -> None:
    """Chat in the terminal, streaming, multi-turn (/help inside lists the commands)."""
    from ..chat import run

    with opts.engine(mode, progress=True) as engine:
        tuning_hint(engine, opts.target)
        doing("the chat", "nothing was written")
        run(engine, system=system, max_tokens=max_tokens, show_tiers=show_tiers, **opts.sampling())


@app.command()
@shared(MODEL_OPTS, SPEC_OPTS, RUN_OPTS)
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to listen on (loopback by default)."),
    port: int = typer.Option(8080, help="Port to listen on."),
    mode: Optional[str] = mode_opt(DEFAULT_MODE, "Default decoding mode; requests may set 'mode'"),
    max_body: int = typer.Option(1 << 20, help="Largest request body in bytes."),
    max_tokens_limit: int = typer.Option(4096, help="Largest max_tokens a request may ask for."),
    parallel: int = typer.Option(DEFAULT_PARALLEL, "--parallel", "-np", help="Requests generated at once, batched "
                                 "into shared decodes (slots; the context is split over them)."),
    max_queue: int = typer.Option(16, help="Requests that may wait for a slot; one more gets a 503."),
    drain: float = typer.Option(10.0, help="On SIGTERM or Ctrl-C, seconds running generations may take to "
                                "finish before they are cancelled."),
    api_key: Optional[List[str]] = typer.Option(None, "--api-key", envvar="VIA_EDGE_API_KEY",
                                                help="Require 'Authorization: Bearer KEY' on every route but "
                                                "/health (repeatable; the environment variable may hold several, "
                                                "comma-separated)."),
    opts: Options = None,
) -> None:
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models, /health)."""
    from ..server import bind, run

    keys = tuple(k.strip() for given in api_key or () for k in given.split(",") if k.strip())
    if api_key and not keys:
        raise ViaEdgeError("--api-key is empty")
    sock = bind(host, port)  # a busy port fails here, before a model loads
    if not keys and not is_loopback(host):
        err(f"warning: serving on {host} without --api-key: anyone who reaches this port can use the model")
    with sock, opts.engine(mode, progress=True, n_parallel=parallel) as engine:
        tuning_hint(engine, opts.target)
        doing("the server", "nothing was written")
        url = f"http://{host}:{sock.getsockname()[1]}/v1"
        slots = f", {parallel} slots of {engine.target.n_ctx} tokens" if parallel > 1 else ""
        helper = ", prefill helper" if engine.target.prefiller is not None else ""
        run(engine, sock, on_ready=lambda: err(f"via-edge serving {engine.model_name} ({engine.mode}, "
                                                f"{engine.format} weights{slots}{helper}) on {url}"),
            drain=drain, max_body=max_body, max_tokens_limit=max_tokens_limit, max_queue=max_queue, api_keys=keys)



@app.command()
def info() -> None:
    """This machine and the llama.cpp build in use: flavor, features, CPU, where models and tuned
    choices live. Tuned choices are kept per machine and build: one made on another is not used."""
    from ..decode.attention import GAIN, stored_choices
    from ..decode.costs import PROMPT_GAIN, stored_prompt_gains
    from ..llama import default_threads, rpc
    from ..machine import build, cpu_name, has_amx, machine_key, versions
    from ..tune.store import tuned_dir
    from ..weights.autoformat import all_stored

    b, v = build(), versions()
    typer.echo(f"via-edge {v['via_edge']}, llama-cpp-python {v['llama-cpp-python']}")
    typer.echo(f"llama.cpp build: {b['flavor']} ({b['source']}; AMX self-check: {b['self_check']})")
    typer.echo(f"features: {' '.join(b['features'])}")
    typer.echo("RPC backend: " + ("yes (`via-edge rpc-serve`, --rpc HOST:PORT)" if rpc.available() else
                                  "no (reinstall with tools/install.sh to get it)"))
    typer.echo(f"cpu: {cpu_name()}, {default_threads()} threads available; AMX in the CPU: "
               f"{'yes' if has_amx() else 'no'}")
    typer.echo(f"machine key: {machine_key()}  (CPU, cores and build: what tuned choices are kept under)")
    typer.echo(f"models: {catalog.model_dir()}  (VIA_EDGE_MODEL_DIR)")
    mine = sorted(p.name.split("--")[0] for p in tuned_dir().glob(f"*--{machine_key()}.choice.json"))
    others = sorted(p.name for p in tuned_dir().glob("*.choice.json") if machine_key() not in p.name)
    typer.echo(f"tuned choices: {tuned_dir()}; for this machine and build: {', '.join(mine) or 'none'}"
               + (f"; {len(others)} made elsewhere (not used here)" if others else ""))
    auto, choices = all_stored(), stored_choices()
    typer.echo(f"automatic weight formats for this machine and build: {'none yet' if not auto else ''}")
    for c in auto:
        typer.echo(f"  {c.source}: {c.format} ({c.reason}; {c.date})")
    typer.echo("flash attention for this machine and build: " + ("none measured yet" if not choices else ""))
    for name, on, gain, threads in choices:
        typer.echo(f"  {name} ({threads} threads): {gain:.2f}x as fast without it, so "
                   + ("on" if on else "off") + f" (off from {GAIN}x)")
    gains = stored_prompt_gains()
    typer.echo("prefill helper (prompts on an unrepacked copy) for this machine and build: "
               + ("none measured yet" if not gains else ""))
    for name, gain, copy, threads in gains:
        typer.echo(f"  {name} ({threads} threads): prompts {gain:.2f}x as fast on {copy}, "
                   + ("used" if gain >= PROMPT_GAIN else f"not used (below {PROMPT_GAIN}x)"))

