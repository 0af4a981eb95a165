"""The target over RPC with network delay: tok/s of ar, lookup and sd with its layers split over this
machine and two `via-edge rpc-serve` processes, at each added delay, against ar all-local
(docs/benchmarks.md; issue 26).

    .venv/bin/python tools/rpc_bench.py [--delays 0,1,5] [--modes ar,lookup,sd] [--suite edit]
        [--prompts 3] [-n 128] [--server-threads 2]

The delay is added by the benchmark itself: each server is reached through a TCP relay that holds
every chunk coming back from the server for `delay` ms (one added delay per round trip, what
`tc qdisc ... netem delay` on one side of a link adds; netem itself needs a kernel module this
machine lacks). Per delay, one engine over the relays; per prompt the methods run back to back in
balanced orders (`run_orders`), all-local ar among them, and each ratio is taken on the same prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import threading
import time

from via_edge import Engine
from via_edge.bench.metrics import in_run_order
from via_edge.bench.runner import prompt_tokens
from via_edge.bench.suite import load_prompts
from via_edge.llama import rpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(threads: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "via_edge", "rpc-serve", "--port", str(port), "--threads",
                             str(threads)], stdout=subprocess.DEVNULL)
    for _ in range(150):
        try:
            rpc.hello(f"127.0.0.1:{port}", timeout=1)
            return proc, port
        except Exception:
            time.sleep(0.2)
    raise RuntimeError("rpc-serve did not start")


class Relay:
    """127.0.0.1:port -> 127.0.0.1:target, holding the server's answers `delay` seconds."""

    def __init__(self, target: int, delay: float) -> None:
        self.target, self.delay, self.port = target, delay, free_port()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", self.port))
        ready.set()
        self.loop.run_until_complete(server.serve_forever())

    async def _client(self, reader, writer) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target)
        for sock in (writer.get_extra_info("socket"), up_w.get_extra_info("socket")):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(self._pipe(reader, up_w, 0.0), self._pipe(up_r, writer, self.delay))

    async def _pipe(self, src, dst, delay: float) -> None:
        """Forward in order; each chunk leaves `delay` after it arrived (a link's latency, not a pause per chunk)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if data is None:
                    dst.close()
                    return
                wait = due - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                dst.write(data)
                await dst.drain()

        sender = asyncio.ensure_future(send())
        try:
            while data := await src.read(1 << 16):
                queue.put_nowait((time.perf_counter() + delay, data))
        finally:
            queue.put_nowait((0.0, None))
            await sender


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--delays", default="0,1,5", help="added delay per round trip, ms")
    ap.add_argument("--modes", default="ar,lookup,sd")
    ap.add_argument("--suite", default="edit")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--server-threads", type=int, default=2)
    args = ap.parse_args()
    modes = args.modes.split(",")
    prompts = load_prompts(args.suite, None, 100)[:args.prompts]
    servers = [start_server(args.server_threads) for _ in range(2)]
    rows = []
    try:
        local = Engine.from_pair(mode="ar")
        for mode in modes:
            local.prepare(mode)
        for delay in (float(d) for d in args.delays.split(",")):
            relays = [Relay(port, delay / 1e3) for _, port in servers]
            remote = Engine.from_pair(mode="ar", rpc=[f"127.0.0.1:{r.port}" for r in relays])
            for mode in modes:
                remote.prepare(mode)
            methods = [("local", "ar")] + [("rpc", m) for m in modes]
            speeds: dict[str, list[float]] = {f"{w} {m}": [] for w, m in methods}
            for i, prompt in enumerate(prompts):
                tokens = prompt_tokens(local, prompt)
                for where, mode in in_run_order(methods, i):
                    engine = local if where == "local" else remote
                    engine.reset()
                    res = engine.generate(tokens, mode=mode, max_tokens=args.max_tokens)
                    speeds[f"{where} {mode}"].append(res.stats.tokens_per_second)
                    print(f"delay {delay:g} ms  {prompt.id:28.28s} {where:5s} {mode:6s} "
                          f"{res.stats.tokens_per_second:6.2f} tok/s  {res.stats.target.calls} target calls", flush=True)
            remote.close()
            base = speeds["rpc ar"]
            for key, values in speeds.items():
                ratios = [v / b for v, b in zip(values, base)]
                rows.append((delay, key, statistics.median(values), min(values), max(values),
                             statistics.median(ratios), min(ratios), max(ratios)))
        local.close()
    finally:
        for proc, _ in servers:
            proc.terminate()
    print(f"\n{len(prompts)} prompts of {args.suite}, at most {args.max_tokens} tokens; two rpc-serve processes "
          f"({args.server_threads} threads each) on this machine")
    print("| added delay | method | tok/s median (min..max) | vs ar over RPC (min..max) |")
    print("| --- | --- | --- | --- |")
    for delay, key, med, lo, hi, r, rlo, rhi in rows:
        print(f"| {delay:g} ms | {key} | {med:.1f} ({lo:.1f}..{hi:.1f}) | {r:.2f}x ({rlo:.2f}..{rhi:.2f}) |")


if __name__ == "__main__":
    main()
