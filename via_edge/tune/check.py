"""The tuner's last stage: the predicted best configuration of each mode run for real on held-out
prompts, interleaved with `ar`, so the report sets prediction beside measurement."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from ..bench.metrics import fidelity, geomean, in_run_order
from ..decode.spec import SpecParams
from ..engine import Engine
from ..llama import LoadParams
from .choose import Candidate


BASE = "ar (shipped)"  # the baseline's key in the checks when the choice is on another format


def verify(target_path: Path, draft_path: Path, best: dict[str, Candidate], prompts, verify_tokens: int,
           load: LoadParams, log: Callable[[str], None], baseline: Path | None = None) -> dict:
    """Each mode's best configuration against ar on held-out prompts, interleaved in balanced orders.

    With `baseline` (the shipped file, when `target_path` is a derived format), ar on it runs
    beside them and every ratio and agreement is to it, so a format's speed and loss show up.
    """
    slim = next((c.slim for c in best.values() if c.slim), None)  # one slim for all modes (see tune)
    engine = Engine(target_path, draft_path, slim_layers=slim, load=load)
    base = Engine(baseline, load=load) if baseline else None
    runners = {m: (engine, m, best[m].spec) for m in best}
    if base:
        runners[BASE] = (base, "ar", SpecParams())
    ref = BASE if base else "ar"
    methods = list(runners)
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    try:
        for m in best:
            engine.prepare(m)
        log(f"verifying {', '.join(methods)} on {len(prompts)} held-out prompts x {verify_tokens} tokens")
        for i, p in enumerate(prompts):
            tokens = engine.tokens_for(p.text, True)
            for m in in_run_order(methods, i):
                e, mode, spec = runners[m]
                e.reset()
                res = e.generate(tokens, mode=mode, max_tokens=verify_tokens, spec=spec)
                runs[m].append({"prompt": p.id, "tokens": res.tokens, "tok_s": res.stats.tokens_per_second})
    finally:
        engine.close()
        if base:
            base.close()
    out = {}
    ar = {r["prompt"]: r for r in runs[ref]}
    for m in methods:
        if not runs[m]:
            continue
        ratios = [r["tok_s"] / ar[r["prompt"]]["tok_s"] for r in runs[m]]
        agree = [fidelity(ar[r["prompt"]]["tokens"], r["tokens"])["agreement"] for r in runs[m]]
        c = best.get(m)
        out[m] = {"label": c.label() if c else "ar on the shipped file", "predicted_speedup": c.speedup if c else 1.0,
                  "measured_speedup": geomean(ratios), "speedup_spread": [min(ratios), max(ratios)],
                  "measured_agreement": float(np.mean(agree)), "predicted_fidelity": c.fidelity if c else 1.0,
                  "tok_s": float(np.median([r["tok_s"] for r in runs[m]]))}
        out[m]["prediction_error"] = out[m]["measured_speedup"] / out[m]["predicted_speedup"] - 1
        log(f"  {m:6s} predicted {out[m]['predicted_speedup']:.2f}x, measured {out[m]['measured_speedup']:.2f}x "
            f"(agreement {out[m]['measured_agreement']:.2f})")
    return out
