"""The tune report: tune.json (everything), report.md (what a person reads), frontier.png."""

from __future__ import annotations

from pathlib import Path

from .. import plotting
from ..bench.metrics import fmt as _f
from ..files import write_json, write_text
from ..machine import machine_key
from .store import tuned_dir

COLORS = {"ar": "black", "sd": "tab:blue", "lookup": "tab:green", "hier": "tab:purple", "via": "tab:orange"}


def write_outputs(result: dict, out: Path | None) -> list[Path]:
    folder = Path(out) if out else tuned_dir() / f"{result['meta']['pair']}--{machine_key()}"
    folder.mkdir(parents=True, exist_ok=True)
    paths = [write_json(folder / "tune.json", result), write_text(folder / "report.md", render_markdown(result))]
    png = plot_frontier(result, folder / "frontier.png")
    return paths + ([png] if png else [])


def render_markdown(r: dict) -> str:
    meta, prof = r["meta"], r["profile"]
    m = meta["machine"]
    t = meta["timings"]
    cfg = meta["config"]
    lines = [
        f"# via-edge tune: {meta['pair']}",
        "",
        f"- date: {meta['date']}; machine: {m['cpu']}, {m['cores']} cores ({m['threads_used']} threads), key `{m['key']}`",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        f"- time: {t['total']:.0f} s in all (formats {t.get('formats', 0):.0f}, profile {t['profile']:.0f}, record {t['record']:.0f}, search "
        f"{t['search']:.0f}, predict {t['predict']:.0f}, verify {t['verify']:.0f})",
        f"- calibration: Spec-Bench ids {', '.join(meta['calibration'])} ({cfg['calib_tokens']} target tokens each); "
        f"held-out: {', '.join(meta['heldout'])} ({cfg['verify_tokens']} tokens each); fidelity floor "
        f"{cfg['fidelity_floor']} at {cfg['out_length']} tokens",
        "",
        f"**Choice: {r['choice']['summary']}**",
        "",
        *([ "Skipped, to keep the tune short:", "", *(f"- {x}" for x in meta["skipped"]), ""]
          if meta.get("skipped") else []),
        *([f"## Weight formats (quality floor {cfg.get('quality_floor')}: teacher-forced top-1 agreement with the "
           f"shipped file; costs at context 384, interleaved)", "", r["formats_table"], "",
           f"The draft runs {r['choice'].get('draft_format', 'shipped')} from here on (the cheapest single-token "
           "format that clears the floor); each passing target format is replayed below with the shipped "
           "profile scaled by its measured cost ratio per batch size.", ""] if r.get("formats_table") else []),
        f"## Cost profile (median ms per decode call at context {prof['contexts'][1]})",
        "",
        f"Slim costs by block count, interpolated between the measured sizes and the target, are within "
        f"{_f(prof['meta']['fit_error']['median'] * 100, 0)}% of the measured ones (median over all points; worst "
        f"point {_f(prof['meta']['fit_error']['max'] * 100, 0)}%).",
        "",
        "| model | blocks | " + " | ".join(f"n={n}" for n in prof["batches"] if n in (1, 2, 3, 4, 6, 8, 12, 16)) + " |",
        "| --- | --- | " + " | ".join("---" for n in prof["batches"] if n in (1, 2, 3, 4, 6, 8, 12, 16)) + " |",
    ]
    for model, rows in prof["table"].items():
        row = rows[1]
        lines.append(f"| {model} | {prof['blocks'][model]} | " + " | ".join(
            f"{row[i] * 1e3:.0f}" for i, n in enumerate(prof["batches"]) if n in (1, 2, 3, 4, 6, 8, 12, 16)) + " |")
    lines += [
        "",
        f"## Slim search ({len(r['search'])} slims scored on the search prompts; budget {meta['block_budget']} of "
        f"{meta['n_blocks']} blocks; the draft agrees with the target on {meta['draft_agreement']:.2f})",
        "",
        "| layers | blocks | found by | agreement |",
        "| --- | --- | --- | --- |",
    ]
    for s in sorted(r["search"], key=lambda s: (s["blocks"] > meta["block_budget"], -s["agreement"])):
        over = " (over budget: a step of the greedy removal)" if s["blocks"] > meta["block_budget"] else ""
        lines.append(f"| {s['layers']} | {s['blocks']}{over} | {s['strategy']} | {s['agreement']:.3f} |")
    lines += ["", "Finalists on every calibration prompt (tier A/B: share of tokens routed there at the default "
              "thresholds, and how often that tier's token is the target's):", "",
              "| layers | agreement | tier A share | tier A precision | tier B share | tier B precision |",
              "| --- | --- | --- | --- | --- | --- |"]
    for s in r["finalists"]:
        lines.append(f"| {s['layers']} | {s['agreement']:.3f} | {_f(s['tier_a_share'])} | {_f(s['tier_a_precision'])} "
                     f"| {_f(s['tier_b_share'])} | {_f(s['tier_b_precision'])} |")
    lines += ["", "## Best configuration per mode (replayed offline on the calibration traces)", "",
              "| mode | configuration | predicted speedup | predicted fidelity | measured speedup (min–max) | "
              "measured agreement | prediction error |", "| --- | --- | --- | --- | --- | --- | --- |"]
    rows = list(r["best"].items()) + [(f"{m} (below the floor)", c) for m, c in r.get("below_floor", {}).items()]
    for mode, c in rows:
        v = r["verify"].get(mode.split()[0], {})
        spread = v.get("speedup_spread")
        lines.append(f"| {mode} | {c['label']} | {c['speedup']:.2f}x | {c['fidelity']:.3f} | "
                     + (f"{v['measured_speedup']:.2f}x ({spread[0]:.2f}–{spread[1]:.2f}) | {v['measured_agreement']:.2f} | "
                        f"{v['prediction_error']:+.0%} |" if v else "not run | | |"))
    base = r["verify"].get("ar (shipped)")
    if base:
        lines.append(f"| ar (shipped file, the baseline) | ar | 1.00x | 1.000 | 1.00x | 1.00 | |  \n\n"
                     f"Measured ratios and agreements are to ar on the shipped file ({base['tok_s']:.1f} tok/s median).")
    lines += ["", "## Frontier (predicted speedup vs fidelity; nothing beats these on both)", ""]
    lines += [f"- {label}" for label in r["frontier"]]
    lines += ["", "![frontier](frontier.png)", ""]
    return "\n".join(lines)


def plot_frontier(r: dict, path: Path) -> Path | None:
    fig = plotting.figure(figsize=(9, 5.5))
    if fig is None:
        return None
    ax = fig.subplots()
    for mode, color in COLORS.items():
        pts = [c for c in r["candidates"] if c["mode"] == mode]
        if pts:
            ax.scatter([c["speedup"] for c in pts], [c["fidelity"] for c in pts], s=10, alpha=0.45, color=color,
                       label=f"{mode} (predicted)")
    lab = {c["label"]: c for c in r["candidates"]}
    fr = [lab[x] for x in r["frontier"] if x in lab]
    ax.plot([c["speedup"] for c in fr], [c["fidelity"] for c in fr], "k--", lw=1, label="frontier")
    for mode, v in r["verify"].items():
        ax.scatter([v["measured_speedup"]], [v["measured_agreement"]], marker="X", s=90, color=COLORS.get(mode, "grey"),
                   edgecolor="black", label=f"{mode} measured")
    floor = r["meta"]["config"]["fidelity_floor"]
    ax.axhline(floor, color="red", lw=0.8, ls=":", label=f"fidelity floor {floor}")
    ax.axvline(1.0, color="grey", lw=0.8)
    ch = r["choice"]
    ax.set_title(f"{r['meta']['pair']}: predicted speed vs fidelity; chosen: {ch['mode']}")
    ax.set_xlabel("speedup over ar (tok/s ratio)")
    ax.set_ylabel("token agreement with the target's greedy output")
    ax.legend(fontsize=7, loc="lower left")
    plotting.save(fig, path)
    return path
