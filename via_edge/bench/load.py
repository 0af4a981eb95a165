"""The load benchmark (`via-edge bench --serve`): concurrent clients against `via-edge serve`.

It starts one server per slot count on 127.0.0.1 (always one with `--parallel 1`, today's
one-at-a-time server, as the baseline) and drives each with the official `openai` client from N
threads that share a fixed list of streamed chat requests. Per repeat, the baseline serves the
list once (one client: more would only queue) and every client count runs on every other server,
in rotating order, so the ratios compare the same requests in the same minutes of a noisy machine. Reported per server and client count: aggregate tok/s (all
completion tokens over the wall time), its ratio to the one-at-a-time server, p50/p95 latency and
time to first token, and how many answers equal the one-at-a-time server's. Every run starts
with the server's caches erased: slots would otherwise still hold prompts of the last run.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import plotting
from ..errors import ViaEdgeError
from ..files import write_text
from ..machine import machine
from .suite import Prompt


@dataclass
class LoadConfig:
    prompts: list[Prompt]
    clients: list[int]
    parallel: list[int]                  # slot counts to compare with --parallel 1
    max_tokens: int = 64
    repeats: int = 3
    server_args: list[str] = field(default_factory=list)  # model and run options, as for `via-edge serve`
    command: str = ""


@dataclass
class Request:
    index: int
    ttft: float
    latency: float
    tokens: int
    text: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `via-edge serve` subprocess on loopback."""

    def __init__(self, parallel: int, args: list[str]) -> None:
        import httpx

        self.parallel, self.port = parallel, _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "via_edge", "serve", "--port", str(self.port),
                                      "--parallel", str(parallel), "--max-queue", "1024", *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise ViaEdgeError(f"the server (--parallel {parallel}) did not start:\n{self.proc.stderr.read()}")
            try:
                self.health = httpx.get(self.base + "/health", timeout=2).json()
                return
            except (httpx.HTTPError, ValueError):
                time.sleep(0.5)
        self.close()
        raise ViaEdgeError(f"the server (--parallel {parallel}) did not answer within 10 minutes")

    @property
    def name(self) -> str:
        return "one-at-a-time" if self.parallel == 1 else f"parallel {self.parallel}"

    def erase(self) -> None:
        """Forget every slot's cached prompts, so a run's prompts are not already in a cache."""
        import httpx

        httpx.post(self.base + "/slots", params={"action": "erase"}, timeout=30).raise_for_status()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _ask(client, model: str, prompt: str, max_tokens: int) -> tuple[float, float, int, str]:
    t0 = time.perf_counter()
    ttft, tokens, text = None, 0, []
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    latency = time.perf_counter() - t0
    return ttft if ttft is not None else latency, latency, tokens, "".join(text)


def drive(server: Server, prompts: list[str], clients: int, max_tokens: int) -> tuple[float, list[Request]]:
    """Every prompt once, from `clients` threads taking the next prompt as they become free."""
    import openai

    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=3600)
    model = server.health["model"]
    todo = iter(range(len(prompts)))
    lock = threading.Lock()
    done: list[Request] = []

    def worker() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            ttft, latency, tokens, text = _ask(client, model, prompts[i], max_tokens)
            with lock:
                done.append(Request(i, ttft, latency, tokens, text))

    server.erase()  # cold caches: slots kept from the last run would skip those prompts' prefill
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(worker) for _ in range(clients)]:
            f.result()
    return time.perf_counter() - t0, sorted(done, key=lambda r: r.index)


def _pct(values: list[float], q: float) -> float:
    """The q-quantile by linear interpolation (q=0.5: the median)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def run_load(cfg: LoadConfig, log=print) -> dict:
    texts = [p.text for p in cfg.prompts]
    servers: list[Server] = []
    runs = []
    try:
        for p in [1] + [p for p in cfg.parallel if p != 1]:
            log(f"starting the server with --parallel {p}")
            servers.append(Server(p, cfg.server_args))
        for s in servers:  # warm up: page in the weights, build the chat template, fill the caches
            drive(s, texts[:1], 1, 8)
        for rep in range(cfg.repeats):
            for clients in cfg.clients:
                order = servers[rep % len(servers):] + servers[:rep % len(servers)]
                for s in order:
                    if s.parallel == 1 and clients != cfg.clients[0]:
                        continue
                    wall, reqs = drive(s, texts, clients, cfg.max_tokens)
                    tok = sum(r.tokens for r in reqs)
                    log(f"repeat {rep + 1}/{cfg.repeats}  {clients} clients  {s.name:14s} "
                        f"{tok / wall:6.1f} tok/s  ({tok} tokens in {wall:.1f} s)")
                    runs.append({"repeat": rep, "clients": clients, "server": s.name, "parallel": s.parallel,
                                 "wall": wall, "requests": [asdict(r) for r in reqs]})
        health = servers[-1].health
    finally:
        for s in servers:
            s.close()
    meta = {"command": cfg.command, "machine": machine(), "model": health["model"], "weights": health["weights"],
            "mode": health["mode"], "n_ctx_slot": {s.name: s.health["n_ctx_slot"] for s in servers},
            "max_tokens": cfg.max_tokens, "repeats": cfg.repeats, "clients": cfg.clients,
            "prompts": [asdict(p) for p in cfg.prompts], "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    results = {"meta": meta, "runs": runs}
    results["summary"] = summarize_load(results)
    return results


def summarize_load(results: dict) -> list[dict]:
    """Per (server, clients): medians over repeats, and ratios to one-at-a-time within each repeat."""
    runs = results["runs"]
    base = {r["repeat"]: r for r in runs if r["parallel"] == 1}
    rows = []
    for name in dict.fromkeys(r["server"] for r in runs):
        for clients in results["meta"]["clients"]:
            mine = [r for r in runs if r["server"] == name and r["clients"] == clients]
            if not mine:
                continue
            agg = [sum(q["tokens"] for q in r["requests"]) / r["wall"] for r in mine]
            ratio = [a / (sum(q["tokens"] for q in base[r["repeat"]]["requests"]) / base[r["repeat"]]["wall"])
                     for a, r in zip(agg, mine)]
            reqs = [q for r in mine for q in r["requests"]]
            same = [q["text"] == bq["text"] for r in mine for q, bq in zip(r["requests"], base[r["repeat"]]["requests"])]
            rows.append({"server": name, "parallel": mine[0]["parallel"], "clients": clients,
                         "tok_s": statistics.median(agg), "tok_s_min": min(agg), "tok_s_max": max(agg),
                         "ratio": statistics.median(ratio), "ratio_min": min(ratio), "ratio_max": max(ratio),
                         "latency_p50": _pct([q["latency"] for q in reqs], 0.5),
                         "latency_p95": _pct([q["latency"] for q in reqs], 0.95),
                         "ttft_p50": _pct([q["ttft"] for q in reqs], 0.5),
                         "ttft_p95": _pct([q["ttft"] for q in reqs], 0.95),
                         "same_text": sum(same), "requests": len(same)})
    return rows


def render_load(results: dict) -> str:
    m = results["meta"]
    lines = [f"# Load benchmark: {m['model']} ({m['weights']}, mode {m['mode']})", "",
             f"`{m['command']}` — {m['time']}, {m['machine'].get('cpu', '?')}; {len(m['prompts'])} streamed chat "
             f"requests of at most {m['max_tokens']} tokens (Spec-Bench), greedy, {m['repeats']} repeats; "
             f"context per slot: " + ", ".join(f"{k} {v}" for k, v in m["n_ctx_slot"].items()) + ".", "",
             "| server | clients | aggregate tok/s (min..max) | vs one-at-a-time (min..max) | latency p50 / p95 s "
             "| TTFT p50 / p95 s | same text as one-at-a-time |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results["summary"]:
        lines.append(f"| {r['server']} | {r['clients']} | {r['tok_s']:.1f} ({r['tok_s_min']:.1f}..{r['tok_s_max']:.1f}) "
                     f"| {r['ratio']:.2f}x ({r['ratio_min']:.2f}..{r['ratio_max']:.2f}) "
                     f"| {r['latency_p50']:.2f} / {r['latency_p95']:.2f} | {r['ttft_p50']:.2f} / {r['ttft_p95']:.2f} "
                     f"| {r['same_text']}/{r['requests']} |")
    lines += ["", "Aggregate tok/s: every completion token of the request list over the wall time from the first "
              "request to the last answer. Ratios are taken within one repeat (the same requests, minutes apart) and "
              "their median and range reported. One-at-a-time is `via-edge serve --parallel 1` serving the list to one "
              "client (more clients would only queue behind it); more clients than slots queue. Answers differ from one-at-a-time only where batched kernels round differently "
              "(see docs/benchmarks.md, kernels).", ""]
    return "\n".join(lines)


def plot_load(results: dict, path: Path) -> bool:
    """load.png: aggregate tok/s and latency per client count, per server. False without matplotlib."""
    fig = plotting.figure(figsize=(12, 4.5))
    if fig is None:
        return False
    ax1, ax2 = fig.subplots(1, 2)
    for name in dict.fromkeys(r["server"] for r in results["summary"]):
        rows = [r for r in results["summary"] if r["server"] == name]
        xs = [r["clients"] for r in rows]
        ax1.errorbar(xs, [r["tok_s"] for r in rows], marker="o", label=name,
                     yerr=[[r["tok_s"] - r["tok_s_min"] for r in rows], [r["tok_s_max"] - r["tok_s"] for r in rows]])
        ax2.plot(xs, [r["latency_p50"] for r in rows], marker="o", label=f"{name} p50")
        ax2.plot(xs, [r["ttft_p50"] for r in rows], marker="x", ls="--", label=f"{name} TTFT p50")
    ax1.set_xlabel("concurrent clients")
    ax1.set_ylabel("aggregate tok/s (median, min..max)")
    ax1.set_title("Throughput")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("concurrent clients")
    ax2.set_ylabel("seconds")
    ax2.set_title("Latency and time to first token")
    ax2.legend(fontsize=7)
    for ax in (ax1, ax2):
        ax.set_xticks(results["meta"]["clients"])
    plotting.save(fig, path)
    return True


def write_load(results: dict, out: Path) -> list[Path]:
    files = [write_text(out / "load.json", json.dumps(results, indent=1)),
             write_text(out / "load.md", render_load(results))]
    if plot_load(results, out / "load.png"):
        files.append(out / "load.png")
    return files
