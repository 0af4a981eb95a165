"""Where a tune run's prediction error comes from, factor by factor, on its own held-out prompts.

    .venv/bin/python tools/tune_error.py docs/tune/qwen2.5-coder-quiet

`via-edge tune` predicts each mode's speed-up on calibration prompts and checks it on held-out
ones. Measured / predicted is split here into four factors, each a geometric mean over prompts
of ratios to `ar` on the same prompt, so that their product is the whole error:

- prompts: the replay on the held-out prompts' own traces against the replay on the calibration
  traces (what the prompts change: acceptance, lookup hits);
- path: the profile's price of the calls the real run made against the replay's calls on the
  same traces (where the real run left the trace: batched kernels that decide differently);
- prices: the real decode seconds of those calls against the profile's price for them (the
  machine now against the machine while profiling);
- python: wall time of the generation against its decode seconds (the loop's own work).

Every model call is timed by the adapter's decode observer (`LlamaModel.observers`);
calls that only fill the prompt are left out, as the replay and the tok/s figures leave them out.
The profile, the configurations and the held-out prompts are the tune run's (`tune.json`).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from via_edge import Engine
from via_edge.bench.metrics import geomean
from via_edge.decode.costs import CostProfile
from via_edge.decode.copying import CopyDrafter, CopyPolicy
from via_edge.decode.spec import SpecParams
from via_edge.tune.record import calibration_prompts, record, slim_traces
from via_edge.tune.replay import replay
from via_edge.weights import catalog

FACTORS = ("prompts", "path", "prices", "python")


def instrument(model, role: str, calls: list) -> None:
    """Log (role, tokens, context, seconds) of every decode of `model` (the adapter's observer)."""
    def observe(parts, seconds: float) -> None:
        calls.append((role, sum(len(c) for _, c, _ in parts), len(parts[0][0].tokens), seconds))
    model.observers.append(observe)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tune_dir", type=Path)
    ap.add_argument("--tokens", type=int, default=None, help="tokens per prompt (default: the tune run's)")
    a = ap.parse_args()
    tune = json.loads((a.tune_dir / "tune.json").read_text())
    meta, cfg = tune["meta"], tune["meta"]["config"]
    tokens = a.tokens or cfg["verify_tokens"]
    profile = CostProfile.from_dict(tune["profile"])
    best = {m: c for m, c in tune["best"].items() if c["format"] == "shipped"}
    slim = next((c["slim"] for c in best.values() if c["slim"]), None)
    held = {p.id: p for p in calibration_prompts(1, skip=1)}
    prompts = [held[i] for i in meta["heldout"]]
    pair = catalog.pair(meta["pair"])
    load = tune["profile"]["meta"]["load"]
    engine = Engine(catalog.resolve(pair["target"]), catalog.resolve(pair["draft"]), slim_layers=slim,
                    n_ctx=load["n_ctx"], n_threads=load["n_threads"], flash_attn=load["flash_attn"],
                    use_extra_bufts=load["use_extra_bufts"], kv_type=load["kv_type"])
    with engine:
        for m in best:
            engine.prepare(m)
        models = {"target": engine.models.target, "draft": engine.models.draft, "slim": engine.models.slim}
        slim_name = f"slim-{models['slim'].n_layer}" if models["slim"] is not None else "slim"
        toks = [engine.tokens_for(p.text, True) for p in prompts]
        print(f"recording {len(prompts)} held-out prompts x {tokens} tokens", flush=True)
        traces = record(models["target"], models["draft"], toks, tokens)
        sts = slim_traces(models["slim"], traces)[0] if models["slim"] is not None else None
        eog = [t for t in range(models["target"].n_vocab) if models["target"].is_eog(t)]
        engine.prepare("lookup")
        lookup = CopyDrafter(CopyPolicy(engine.models.batch_cost))  # the policy the real runs use
        specs = {m: SpecParams(**c["spec"]) for m, c in best.items()}
        replayed = {m: [replay(t, sts[i] if sts and best[m]["slim"] else None, m, specs[m], profile.cost, eog,
                               slim_model=slim_name, lookup=lookup if m == "lookup" else None).seconds
                        for i, t in enumerate(traces)] for m in best}

        calls: list = []
        for role, model in models.items():
            if model is not None:
                instrument(model, role, calls)
        names = {"target": "target", "draft": "draft", "slim": slim_name}
        real: dict[str, list[tuple[float, float, float]]] = defaultdict(list)  # (priced, decode, wall)
        methods = list(best)
        for i, (p, tk) in enumerate(zip(prompts, toks)):
            for m in methods[i % len(methods):] + methods[:i % len(methods)]:
                engine.reset()
                calls.clear()
                res = engine.generate(tk, mode=m, max_tokens=tokens, spec=specs[m])
                gen = [c for c in calls if c[2] + c[1] > len(tk) - 1]  # past the prompt fill
                real[m].append((sum(profile.cost(names[r], n, ctx) for r, n, ctx, _ in gen),
                                sum(dt for *_, dt in gen), res.stats.generate_seconds))
            print(f"  prompt {p.id} done", flush=True)

    print(f"\n{a.tune_dir}: {len(prompts)} held-out prompts x {tokens} tokens; factors multiply to measured/predicted\n")
    print("| mode | predicted (calibration) | replay on held-out | priced real calls | real decode | measured "
          "| error | " + " | ".join(FACTORS) + " |")
    print("| --- " * (7 + len(FACTORS)) + "|")
    for m in methods:
        ar, mine = real["ar"], real[m]
        held_pred = geomean([a_ / b for a_, b in zip(replayed["ar"], replayed[m])])
        priced, decode, wall = (geomean([x[k] / y[k] for x, y in zip(ar, mine)]) for k in range(3))
        cal = best[m]["speedup"]
        factors = [held_pred / cal, priced / held_pred, decode / priced, wall / decode]
        print(f"| `{m}` | {cal:.2f}x | {held_pred:.2f}x | {priced:.2f}x | {decode:.2f}x | {wall:.2f}x "
              f"| {wall / cal - 1:+.0%} | " + " | ".join(f"{f - 1:+.0%}" for f in factors) + " |")
    shares = {m: 1 - sum(x[1] for x in real[m]) / sum(x[2] for x in real[m]) for m in methods}
    print("\nwall time outside decode calls: " + ", ".join(f"{m} {s:.1%}" for m, s in shares.items()))
    ratio = {m: sum(x[1] for x in real[m]) / sum(x[0] for x in real[m]) for m in methods}
    print("real decode seconds / profile price: " + ", ".join(f"{m} {r:.2f}" for m, r in ratio.items()))


if __name__ == "__main__":
    main()
