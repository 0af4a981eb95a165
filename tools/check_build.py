#!/usr/bin/env python3
"""Self-check of a llama.cpp build's AMX kernels: do they run, and do they compute what the plain
kernels compute?

For each quantized type with AMX kernels that via-edge's formats use (Q4_0, Q8_0, Q4_K, Q6_K), a
tiny model with shapes the AMX path accepts (rows a multiple of 32, columns of 256) is decoded in
one batch twice: weights in llama.cpp's extra buffer types (AMX) and without them (plain kernels).
Each decode runs in a child process, so a SIGILL from unconfigured tiles (llama.cpp #20824) is a
failed check, not a dead installer. A type passes when every row's argmax is the same and
max |difference| <= TOLERANCE x the row's logit range: the two paths accumulate in different orders,
so rows agree closely but not bit for bit (measured: at most 0.42% of the range, docs/benchmarks.md,
section 19).

    .venv/bin/python tools/check_build.py            # one line per type, exit 1 on any failure
Run by tools/install.sh after an amx build (it falls back to noamx on failure) and by the tests
on machines with AMX.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import signal
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_gguf import make_tiny_gguf  # noqa: E402

from via_edge.machine import has_amx  # noqa: E402

TYPES = {"Q4_0": "Q4_0", "Q8_0": "Q8_0", "Q4_K": "Q4_K_M", "Q6_K": "Q6_K"}  # type -> llama ftype
TOLERANCE = 0.05
PROMPT_TOKENS = 24


def _decode(path: str, extra_bufts: bool, out: str) -> None:
    """Child process: load, decode one batch with every row's logits, save them and the buffer
    types llama.cpp named while loading."""
    from via_edge import llama

    seen: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    log = logging.getLogger("via_edge.llama")  # llama.cpp's own log, routed there by the adapter
    log.setLevel(logging.INFO)
    log.addHandler(Grab())
    log.propagate = False
    params = llama.LoadParams(n_ctx=128, n_threads=2, use_extra_bufts=extra_bufts)
    with llama.LlamaModel(path, params) as model:
        tokens = [(7 * i + 3) % 250 for i in range(PROMPT_TOKENS)]
        rows = np.array(model.seqs[0].decode(tokens, "all"))
    buffers = [line.split("model buffer size")[0].split(":")[-1].strip()
               for line in seen if "model buffer size" in line]
    np.save(out, rows)
    Path(out + ".json").write_text(json.dumps(buffers))


def _run_child(path: Path, extra_bufts: bool, work: Path) -> tuple[np.ndarray | None, list[str], int]:
    out = str(work / f"{path.stem}-{int(extra_bufts)}")
    proc = mp.get_context("spawn").Process(target=_decode, args=(str(path), extra_bufts, out))
    proc.start()
    proc.join(300)
    if proc.is_alive():
        proc.kill()
        return None, [], -9
    if proc.exitcode != 0:
        return None, [], proc.exitcode
    return np.load(out + ".npy"), json.loads(Path(out + ".json").read_text()), 0


def check_type(qtype: str, work: Path, source: Path) -> tuple[bool, str]:
    """(passed, one line saying what was found) for one quantized type."""
    from via_edge import llama

    path = work / f"tiny-{qtype}.gguf"
    llama.quantize(source, path, TYPES[qtype])
    amx, buffers, rc = _run_child(path, True, work)
    if amx is None:
        reason = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        return False, f"{qtype}: the decode with AMX weights crashed ({reason})"
    if not any("AMX" in b for b in buffers):
        return False, f"{qtype}: llama.cpp put no weights in the AMX buffer type (buffers: {', '.join(buffers)})"
    plain, _, rc = _run_child(path, False, work)
    if plain is None:
        return False, f"{qtype}: the decode with plain kernels failed (exit code {rc})"
    spread = plain.max(axis=1) - plain.min(axis=1)
    worst = float((np.abs(amx - plain).max(axis=1) / spread).max())
    same_argmax = bool((amx.argmax(axis=1) == plain.argmax(axis=1)).all())
    ok = same_argmax and worst <= TOLERANCE
    verdict = "ok" if ok else "MISMATCH"
    return ok, (f"{qtype}: {verdict}: {amx.shape[0]} rows, max |AMX - plain| = {worst:.4f} of the logit "
                f"range (tolerance {TOLERANCE}), argmax {'identical' if same_argmax else 'differs'}")


def run_checks(types: list[str] | None = None) -> list[tuple[bool, str]]:
    with tempfile.TemporaryDirectory(prefix="via-edge-check-") as tmp:
        work = Path(tmp)
        source = make_tiny_gguf(work / "tiny-f32.gguf", blocks=2, n_embd=256, n_head=4, n_head_kv=2,
                                n_ff=512, seed=7, extra_tokens=41)  # vocabulary 320
        return [check_type(t, work, source) for t in (types or list(TYPES))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quiet", action="store_true", help="print one line: the verdict and the first failure")
    ap.add_argument("--types", default=",".join(TYPES), help="comma-separated subset of " + ",".join(TYPES))
    args = ap.parse_args(argv)
    if not has_amx():
        print("check_build: this CPU has no AMX (no amx_int8 in /proc/cpuinfo); nothing to check")
        return 0
    from via_edge.llama import system_info

    if "AMX_INT8 = 1" not in system_info():
        print("check_build: this llama.cpp build has no AMX kernels (AMX_INT8 is off); nothing to check")
        return 0
    results = run_checks([t.strip() for t in args.types.split(",") if t.strip()])
    if not args.quiet:
        for _, line in results:
            print("check_build: " + line)
    failed = [line for ok, line in results if not ok]
    if failed:
        print(f"check_build: AMX kernels FAILED for {len(failed)} of {len(results)} types; first: {failed[0]}")
        return 1
    print(f"check_build: AMX kernels agree with the plain kernels ({len(results)} types)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
