"""Generate with the default pair, plain and speculative, and compare speed and output."""

from via_edge import Engine

PROMPT = "Write a Python function that checks whether a string is a palindrome."

with Engine.from_pair("qwen2.5-coder", pull_missing=True) as engine:
    for mode in ("ar", "sd"):
        result = engine.generate(PROMPT, mode=mode, max_tokens=96)
        s = result.stats
        print(f"--- {mode}: {s.tokens_per_second:.1f} tok/s, drafted {s.draft_n}, accepted {s.draft_n_accepted}")
        print(result.text)
