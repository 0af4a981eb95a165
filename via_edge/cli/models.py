"""`via-edge models ...` and `via-edge slim ...`: the files via-edge fetches, derives and deletes."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..errors import InvalidParameterError, ViaEdgeError
from ..files import write_text
from ..tune.survey import QUALITY_FLOOR, check_floor
from ..weights import catalog, derived
from ..weights.formats import AMX_FORMATS, FORMAT_NAMES, OTHER_FORMATS, check_names, default_formats
from .app import models_app, slim_app
from .options import check_range, doing, err, shared


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
               "(`models rm FILE`, `models prune` deletes those no stored choice uses)")
    for d in files:
        use = f"  in use: {used[d.path]}" if d.path in used else ""
        typer.echo(f"  {d.size / 1e9:5.2f} GB  {d.kind:20s} of {derived.source_name(d.source, files):28s} {d.path}{use}")


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
    """Delete the derived files no stored choice (tuned, or automatic format) uses (all with --all)."""
    files = derived.derived_files()
    used = {} if everything else derived.in_use(files)
    gone = [d for d in files if d.path not in used]
    for d in gone:
        typer.echo(f"  {'would delete' if dry_run else 'deleting'} {d.kind} ({d.size / 1e9:.2f} GB) {d.path}")
    freed = sum(d.size for d in gone) if dry_run else sum(derived.remove(d.path) for d in gone)
    typer.echo(f"{'would free' if dry_run else 'freed'} {freed / 1e9:.2f} GB; kept {len(used)} in use by stored choices")


@models_app.command("pull")
@shared()
def models_pull(name: str = typer.Argument(..., help="Model or pair name.")) -> None:
    """Fetch a model (or both models of a pair), verify its SHA-256 and put it in place."""
    doing(f"the download of {name}", f"the partial download is kept; `via-edge models pull {name}` resumes it")
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
    doing(f"the check of {name}")
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
    from ..files import write_json
    from ..llama import LlamaModel, LoadParams
    from ..prompts import chat_tokens
    from ..tune.record import calibration_prompts
    from ..tune.survey import pick, survey, table

    names = format_names(formats_list)
    check_floor(quality_floor)
    check_range("prompts", prompts, 1, 100)
    check_range("tokens", tokens, 1, 1024)
    check_range("repeats", repeats, 1, 100)
    check_range("threads", threads, 1, 1024)
    cat = catalog.load_catalog()
    if name in cat["pairs"]:
        p = catalog.pair(name)
        sources = {"target": catalog.resolve(p["target"], pull_missing=True)}
        if p.get("draft"):
            sources["draft"] = catalog.resolve(p["draft"], pull_missing=True)
    else:
        sources = {"model": catalog.resolve(name, pull_missing=True)}
    load = LoadParams(n_ctx=4096, n_threads=threads)
    doing("the format survey", "finished variants are kept; an unfinished one left no file under its name")
    with LlamaModel(sources[next(iter(sources))], load) as m:
        cal = [chat_tokens(m, [{"role": "user", "content": q.text}]) for q in calibration_prompts(1)[:prompts]]
    rows = survey(sources, names, cal, load, continuation=tokens, repeats=repeats, log=err)
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


def format_names(raw: str | None) -> tuple[str, ...]:
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
    from ..weights.slim import build_slim

    doing("building the slim", "no file was left under the output name")
    typer.echo(str(build_slim(catalog.resolve(target, pull_missing=True), layers, out)))
