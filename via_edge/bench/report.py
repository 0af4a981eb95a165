"""Turn raw benchmark runs into a summary, `results.json`, `report.md` and `speedup.png`."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from .. import plotting
from ..decode.modes import LOSSLESS
from ..errors import InvalidParameterError
from ..files import write_text
from .metrics import fidelity, geomean, log_se, spread
from .metrics import fmt as _f
from .peers import PEERS
from .tasks import mcnemar


REFERENCES = ("ar", "ar:json")  # what every speedup is a ratio to (constrained runs: to ar's constrained)


def key(run: dict) -> tuple[str, int]:
    """What pairs two methods' runs: the prompt and the round (results before rounds had one)."""
    return run["prompt_id"], run.get("round", 0)


def summarize(results: dict) -> dict:
    runs = results["runs"]
    methods = results["meta"]["methods"]
    refs = {m: {key(r): r for r in runs if r["method"] == m} for m in REFERENCES}
    formats = results["meta"].get("formats", {})
    peers = {p: {key(r): r for r in runs if r["method"] == p} for p in methods
             if p.partition("@")[0] in PEERS}  # "llama-server@shipped": a peer on another format
    peers = {p: by_prompt for p, by_prompt in peers.items() if by_prompt}
    summary = {}
    for method in methods:
        # constrained answers (<mode>:json) are compared with ar's constrained answer, the rest with ar's
        ar = refs["ar:json"] if method.endswith(":json") else refs["ar"]
        mine = [r for r in runs if r["method"] == method]
        ratios = [r["tok_s"] / ar[key(r)]["tok_s"] for r in mine if ar[key(r)]["tok_s"] > 0]
        fid = [fidelity(ar[key(r)]["tokens"], r["tokens"]) for r in mine]
        cats, cat_agreement = defaultdict(list), defaultdict(list)
        for r, f in zip(mine, fid):
            cat_agreement[r["category"]].append(f["agreement"])
            if ar[key(r)]["tok_s"] > 0:
                cats[r["category"]].append(r["tok_s"] / ar[key(r)]["tok_s"])
        entry = {
            "prompts": len({r["prompt_id"] for r in mine}), "rounds": len({r.get("round", 0) for r in mine}),
            "tok_s": spread([r["tok_s"] for r in mine]),
            "prefill_s": spread([r["prefill_s"] for r in mine]),
            "speedup": geomean(ratios), "speedup_spread": spread(ratios), "speedup_se": log_se(ratios),
            "per_category": {c: geomean(v) for c, v in cats.items()},
            "per_category_se": {c: log_se(v) for c, v in cats.items()},
            "per_category_agreement": {c: sum(v) / len(v) for c, v in cat_agreement.items()},
            "fidelity": {
                "exact_rate": sum(f["exact"] for f in fid) / len(fid) if fid else float("nan"),
                "prefix_mean": sum(f["prefix"] for f in fid) / len(fid) if fid else float("nan"),
                "prefix_share_mean": sum(f["prefix_share"] for f in fid) / len(fid) if fid else float("nan"),
                "agreement_mean": sum(f["agreement"] for f in fid) / len(fid) if fid else float("nan"),
            },
            # "sd:tuned" is sd with tuned knobs; on another weight format than ar's it is not lossless
            "lossless": (method.split(":")[0].partition("@")[0] in LOSSLESS | set(PEERS)
                         and formats.get(method) == formats.get("ar")),
            "format": formats.get(method, ""),
        }
        # the same ratios against what users already have: llama-cpp-python on the shipped file
        for p, by_prompt in peers.items():
            vs = [r["tok_s"] / by_prompt[key(r)]["tok_s"] for r in mine if by_prompt[key(r)]["tok_s"] > 0]
            entry.setdefault("vs_peers", {})[p] = {"speedup": geomean(vs), "spread": spread(vs), "se": log_se(vs)}
            # the whole request as a user waits for it: the prompt's decode, then the answer
            whole = [request_s(by_prompt[key(r)]) / request_s(r) for r in mine if request_s(r) > 0]
            entry.setdefault("request_vs_peers", {})[p] = {"speedup": geomean(whole), "spread": spread(whole)}
            if "speedup_vs_peer" not in entry:  # the first peer present: the summary table's column
                entry.update(peer=p, speedup_vs_peer=geomean(vs), speedup_vs_peer_spread=spread(vs))
        stats = [r["stats"] for r in mine if "stats" in r]
        if stats:
            def tot(key: str, stats=stats) -> float:
                return sum(s.get(key, 0) for s in stats)  # older results lack newer counters

            gen = tot("generated_tokens")
            entry.update({
                "draft_n": tot("draft_n"), "draft_n_accepted": tot("draft_n_accepted"),
                "copied_share": tot("copied_tokens") / gen if gen else 0.0,
                "mean_draft_length": tot("draft_n") / tot("draft_rounds") if tot("draft_rounds") else 0.0,
                "rejection_rate": 1 - tot("draft_n_accepted") / tot("draft_n") if tot("draft_n") else 0.0,
                "mean_accepted_per_round": tot("draft_n_accepted") / tot("rounds") if tot("rounds") else 0.0,
                "tiers": {"A": tot("tier_a"), "B": tot("tier_b"), "C": tot("tier_c"),
                          "B_replaced": tot("tier_b_replaced")},
                "tier_shares": {t: (tot(k) / gen if gen else 0.0)
                                for t, k in (("A", "tier_a"), ("B", "tier_b"), ("C", "tier_c"))},
                "models": {role: {"calls": sum(s[role]["calls"] for s in stats),
                                  "tokens": sum(s[role]["tokens"] for s in stats),
                                  "seconds": round(sum(s[role]["seconds"] for s in stats), 3)}
                           for role in ("draft", "slim", "target")},
            })
        checked = [r for r in mine if "passed" in r]  # the first round's answers (bench.runner)
        if checked:  # task accuracy, paired with ar's answers to the same problems
            mine_by_id = {r["prompt_id"]: r["passed"] for r in checked}
            both = [pid for pid in mine_by_id if "passed" in ar.get((pid, 0), {})]
            entry["task"] = {"problems": len(checked), "passed": sum(mine_by_id.values()),
                             "pass_at_1": sum(mine_by_id.values()) / len(checked),
                             "vs_ar": mcnemar([mine_by_id[p] for p in both], [ar[p, 0]["passed"] for p in both])}
        summary[method] = entry
    return summary


def _pm(se: float | None) -> str:
    """" ±0.01" for a standard error, nothing where there is none (one run, NaN)."""
    return "" if se is None or se != se else f" ±{_f(se)}"


def _rounds(meta: dict) -> str:
    rounds = meta["params"].get("rounds", 1)
    return f" x {rounds} rounds (each method's runs paired by round, order changed each round)" if rounds > 1 else ""


def request_s(run: dict) -> float:
    """A request's seconds from its prompt to its last token (prefill, then generation)."""
    return run["prefill_s"] + run["gen_s"]


def _peer_table(summary: dict, peers: list[str], key: str, title: str) -> list[str]:
    """A markdown table of each method's `key` ratios (speedup, spread) against each peer."""
    lines = ["", f"## {title}", "", "| method | " + " | ".join(peers) + " |", "| --- |" + " --- |" * len(peers)]
    for method, s in summary.items():
        v = s.get(key, {})
        lines.append(f"| {method} | " + " | ".join(
            f"{_f(v[p]['speedup'])}x ({_f(v[p]['spread']['min'])}–{_f(v[p]['spread']['max'])})" if p in v else ""
            for p in peers) + " |")
    return lines


def _first_peer(summary: dict) -> str:
    return next((s["peer"] for s in summary.values() if "peer" in s), "llama-cpp-python")


def _attention_line(attention: dict) -> list[str]:
    """Which via-edge methods ran with flash attention (measured per model file: decode/attention.py)."""
    said = {True: "on", False: "off", None: "llama.cpp's default"}
    by = {v: [m for m, fa in attention.items() if fa is v] for v in said}
    return ["- flash attention: " + "; ".join(f"{said[v]} for {', '.join(ms)}" for v, ms in by.items() if ms)
            ] if attention else []


def _spec_lines(params: dict) -> list[str]:
    """The knobs each mode ran with (one line per mode: tuned runs differ per mode)."""
    tuned = params.get("tuned")
    head = "- speculation: command-line knobs" + (
        f"; `<mode>:tuned` = the knobs and slim ({tuned['slim_layers']}) `via-edge tune` chose per mode on this "
        f"machine ({tuned['summary']})" if tuned else "")
    spec = params["spec"]
    if "n_draft" in spec:  # results written before per-mode knobs
        return [f"- speculation: {spec}"]
    skip = {"ar": set(spec.get("ar", {}))}
    return [head] + [f"  - {mode}: " + ", ".join(f"{k} {v}" for k, v in knobs.items() if k not in skip.get(mode, ()))
                     for mode, knobs in spec.items() if mode != "ar"]


def render_markdown(results: dict) -> str:
    meta, summary = results["meta"], results["summary"]
    m = meta["machine"]
    lines = [
        "# via-edge benchmark",
        "",
        f"- date: {meta['date']}; command: `{meta['command']}`",
        f"- machine: {m['cpu']}, {m['cores']} cores ({m['threads_used']} threads used), {m['os']}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        "- models: " + "; ".join(f"{role} {v['name']} ({v['blocks']} blocks, sha256 {v['sha256'][:12]})"
                                  for role, v in meta["models"].items()),
        f"- prompts: {len(meta['prompts'])} ({', '.join(sorted({p['category'] for p in meta['prompts']}))})"
        f"{_rounds(meta)}, "
        f"max {meta['params']['max_tokens']} new tokens, greedy, chat template; kernels: "
        f"{'exact (no weight repacking)' if meta['params']['exact_kernels'] else 'fast (llama.cpp defaults)'}"
        f"{', F32 copies of the weights, F32 KV, no flash attention' if meta['params'].get('f32_weights') else ''}",
        *_attention_line(meta.get("attention", {})),
        *_spec_lines(meta["params"]),
        "",
        "## Summary (speedup = geometric mean over prompts of tok/s ÷ `ar` tok/s on the same prompt; "
        "SE = standard error of its logarithm, 0.01 is about ±1%)",
        "",
        f"| method | weights | tok/s median (min–max) | speedup | speedup min–max | SE | vs {_first_peer(summary)} | exact match | identical prefix | token agreement | rejection rate | accepted/round |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for method, s in summary.items():
        t, sp = s["tok_s"], s["speedup_spread"]
        ref = method in REFERENCES  # its ratios are to itself
        vp = (f"{_f(s['speedup_vs_peer'])}x ({_f(s['speedup_vs_peer_spread']['min'])}–"
              f"{_f(s['speedup_vs_peer_spread']['max'])})" if "speedup_vs_peer" in s else "")
        lines.append(
            f"| {method}{'' if s['lossless'] else ' (lossy)'} | {s.get('format', '')} "
            f"| {_f(t['median'], 1)} ({_f(t['min'], 1)}–{_f(t['max'], 1)}) "
            f"| {_f(s['speedup'])}x | {_f(sp['min'])}–{_f(sp['max'])} | {'' if ref else _f(s.get('speedup_se'), 3)} | {vp} "
            f"| {_f(s['fidelity']['exact_rate'])} "
            f"| {_f(s['fidelity']['prefix_share_mean'])} | {_f(s['fidelity']['agreement_mean'])} "
            f"| {_f(s.get('rejection_rate', float('nan')))} | {_f(s.get('mean_accepted_per_round', float('nan')))} |")
    tasks = {m: s["task"] for m, s in summary.items() if "task" in s}
    if tasks:
        lines += ["", "## Task accuracy (answers run against the problems' unit tests; McNemar's exact test "
                  "against `ar` on the same problems)", "",
                  "| method | weights | pass@1 | passed / problems | only this method passes | only ar passes | p-value |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for method, t in tasks.items():
            v = t["vs_ar"]
            lines.append(f"| {method} | {summary[method].get('format', '')} | {_f(t['pass_at_1'], 3)} "
                         f"| {t['passed']} / {t['problems']} | {v['a_only']} | {v['b_only']} | {_f(v['p_value'], 3)} |")
    cats = sorted({p["category"] for p in meta["prompts"]})
    lines += ["", "## Speedup per category (geometric mean, ± the standard error of its logarithm where a "
              "category has two runs or more)", "",
              "| method | " + " | ".join(cats) + " |", "| --- |" + " --- |" * len(cats)]
    for method, s in summary.items():
        ses = {} if method in REFERENCES else s.get("per_category_se", {})  # its ratios are to itself
        lines.append(f"| {method} | " + " | ".join(
            _f(s["per_category"].get(c, float("nan"))) + _pm(ses.get(c)) for c in cats) + " |")
    lines += ["", "## Token agreement with `ar` per category (mean)", "",
              "| method | " + " | ".join(cats) + " |", "| --- |" + " --- |" * len(cats)]
    for method, s in summary.items():
        lines.append(f"| {method} | " + " | ".join(_f(s["per_category_agreement"].get(c, float("nan")))
                                                   for c in cats) + " |")
    present = list(dict.fromkeys(p for s in summary.values() for p in s.get("vs_peers", {})))
    if len(present) > 1:
        lines += _peer_table(summary, present, "vs_peers", "Against each peer (geomean of tok/s ratios, min–max)")
    if present:
        lines += _peer_table(summary, present, "request_vs_peers", "Whole requests against each peer (the peer's "
                             "seconds from prompt to last token ÷ this method's, geomean, min–max)")
    lines += ["", "## Where the time goes (all prompts)", "",
              "| method | prefill median s | draft calls / s | slim calls / s | target calls / s | tiers A / B (replaced) / C | copied share | mean draft length |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for method, s in summary.items():
        if "models" not in s:
            lines.append(f"| {method} | {_f(s['prefill_s']['median'], 3)} | | | | |")
            continue
        mm = s["models"]
        tiers = s["tiers"]
        lines.append(f"| {method} | {_f(s['prefill_s']['median'], 3)} | {mm['draft']['calls']} / {mm['draft']['seconds']} "
                     f"| {mm['slim']['calls']} / {mm['slim']['seconds']} | {mm['target']['calls']} / {mm['target']['seconds']} "
                     f"| {tiers['A']} / {tiers['B']} ({tiers['B_replaced']}) / {tiers['C']} "
                     f"| {_f(s.get('copied_share', float('nan')))} | {_f(s.get('mean_draft_length', float('nan')), 1)} |")
    lines += ["", "Fidelity is measured against `ar`'s greedy output on the same prompt: exact match rate, mean share "
              "of `ar`'s tokens before the first difference, and position-wise token agreement. Lossless methods "
              "differ from `ar` only where batched and single-token kernels round differently (weight repacking); "
              "`via` trades fidelity for skipped target calls.", ""]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> bool:
    """speedup.png: speedup per category and method, and `via`'s tier shares. False without matplotlib."""
    fig = plotting.figure(figsize=(14, 5))
    if fig is None:
        return False
    summary = results["summary"]
    cats = sorted({p["category"] for p in results["meta"]["prompts"]})
    methods = [m for m in summary if m != "ar"]
    ax1, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 1.2]})
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        vals = [summary[method]["per_category"].get(c, 0) for c in cats] + [summary[method]["speedup"]]
        ax1.bar([x + i * width for x in range(len(cats) + 1)], vals, width, label=method)
    ax1.axhline(1.0, color="black", lw=0.8, ls="--")
    ax1.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(cats) + 1)])
    ax1.set_xticklabels(cats + ["overall"], rotation=30, ha="right")
    ax1.set_ylabel("speedup vs ar (tok/s ratio, geometric mean)")
    ax1.set_title("Speedup per category")
    if methods:  # `ar` alone has no bar to name
        ax1.legend(fontsize=8)
    tiered = [m for m in summary if "tier_shares" in summary[m] and m != "ar"]
    bottom = [0.0] * len(tiered)
    for tier, color in (("A", "#4caf50"), ("B", "#ff9800"), ("C", "#2196f3")):
        vals = [summary[m]["tier_shares"][tier] for m in tiered]
        ax2.bar(tiered, vals, bottom=bottom, color=color, label=f"tier {tier}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_ylabel("share of committed tokens")
    ax2.set_title("Who decided each token")
    ax2.legend(fontsize=8)
    ax2.tick_params(axis="x", rotation=30)
    plotting.save(fig, path)
    return True


def write_outputs(results: dict, out: Path) -> list[Path]:
    """results.json (runs and summary), report.md and speedup.png; `results` must carry its summary."""
    files = [write_text(out / "results.json", json.dumps(results, indent=1)),
             write_text(out / "report.md", render_markdown(results))]
    if plot(results, out / "speedup.png"):
        files.append(out / "speedup.png")
    return files


def load_results(path: Path) -> dict:
    path = path / "results.json" if path.is_dir() else path
    try:
        data = json.loads(path.read_text())
        data["summary"]
        return data
    except (OSError, ValueError, KeyError) as exc:
        raise InvalidParameterError(f"{path} is not a via-edge results file: {exc}") from exc


def compare(a: dict, b: dict) -> str:
    """A table of each method's speedup and fidelity in two result files, with the change."""
    lines = [f"A: {a['meta']['date']} {a['meta']['machine']['cpu']}", f"B: {b['meta']['date']} {b['meta']['machine']['cpu']}",
             "", "| method | speedup A | speedup B | change | agreement A | agreement B |", "| --- | --- | --- | --- | --- | --- |"]
    for method in list(dict.fromkeys(list(a["summary"]) + list(b["summary"]))):
        sa, sb = a["summary"].get(method), b["summary"].get(method)
        ga = sa["speedup"] if sa else float("nan")
        gb = sb["speedup"] if sb else float("nan")
        fa = sa["fidelity"]["agreement_mean"] if sa else float("nan")
        fb = sb["fidelity"]["agreement_mean"] if sb else float("nan")
        change = f"{(gb / ga - 1) * 100:+.1f}%" if sa and sb and ga > 0 else "n/a"
        lines.append(f"| {method} | {_f(ga)}x | {_f(gb)}x | {change} | {_f(fa)} | {_f(fb)} |")
    return "\n".join(lines)
