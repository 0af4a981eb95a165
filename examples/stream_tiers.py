"""Stream a VIA-SD answer, colouring each piece by the model that produced it."""

from via_edge import Engine, SpecParams

COLOUR = {"copy": "\033[36m", "draft": "\033[32m", "slim": "\033[33m", "target": "\033[34m"}

with Engine.from_pair("qwen2.5-coder", mode="via", spec=SpecParams(tau_accept=0.95, tau_full=0.5),
                      pull_missing=True) as engine:
    stream = engine.stream("Explain what a closure is in Python, briefly.", max_tokens=96)
    for piece in stream:
        print(f"{COLOUR[piece.origin]}{piece.text}\033[0m", end="", flush=True)
    s = stream.result.stats  # the result travels with the stream, also when it is broken off early
    print(f"\ntiers A/B/C: {s.tier_a}/{s.tier_b}/{s.tier_c}, {s.tokens_per_second:.1f} tok/s")
