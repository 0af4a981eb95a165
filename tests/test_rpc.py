"""The target over llama.cpp's RPC backend: `via-edge rpc-serve` processes on loopback hold a share
of its layers. Greedy output equals the all-local output token for token (F32, exact kernels on
both sides), a server killed mid-generation is a clear error within a bounded time while `serve`
stays up, and what a user gets wrong is one line and exit 2."""

import signal
import socketserver
import struct
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import EXACT, make_tiny_gguf
from test_server import free_port, launch, start
from via_edge import Engine, SpecParams
from via_edge.errors import RemoteDeviceError
from via_edge.llama import LlamaModel, LoadParams, rpc

pytestmark = pytest.mark.skipif(not rpc.available(), reason="llama-cpp-python built without -DGGML_RPC=ON "
                                "(tools/install.sh builds it so)")
PROMPTS = ["hello world", "the cat is here", "some more words in here"]


def rpc_server(threads: int = 1) -> tuple[subprocess.Popen, str]:
    endpoint = f"127.0.0.1:{free_port()}"

    def answers() -> bool:
        try:
            rpc.hello(endpoint, timeout=2)
            return True
        except RemoteDeviceError:
            return False

    port = endpoint.rsplit(":", 1)[1]
    return launch(["rpc-serve", "--port", port, "--threads", threads], answers, "rpc-serve", 30), endpoint


@pytest.fixture(scope="module")
def servers():
    started = [rpc_server(), rpc_server()]
    yield [e for _, e in started]
    for proc, _ in started:
        proc.terminate()
        proc.wait(10)


def test_greedy_output_over_one_and_two_servers_equals_all_local(tiny_target, servers):
    spec = SpecParams(n_draft=4)
    with Engine(tiny_target, draft_layers="0-1", **EXACT) as local:
        want = {(p, m): local.generate(p, mode=m, max_tokens=40, chat_template=False, spec=spec).tokens
                for p in PROMPTS for m in ("ar", "sd", "lookup")}
    for eps, split in ((servers[:1], (1, 1)), (servers, (1, 1, 1)), (servers, (0, 1, 1))):
        with Engine(tiny_target, draft_layers="0-1", rpc=eps, tensor_split=split, **EXACT) as remote:
            assert remote.models.target.n_remote_layers > 0
            for (p, m), tokens in want.items():
                assert remote.generate(p, mode=m, max_tokens=40, chat_template=False, spec=spec).tokens == tokens, \
                    (eps, split, p, m)


def test_a_server_killed_mid_generation_is_a_clear_error_and_serve_stays_up(tiny_dir):
    long = make_tiny_gguf(tiny_dir / "long.gguf", blocks=4, seed=1, context_length=4096)  # room for a long answer
    with LlamaModel(long, LoadParams(n_ctx=64)) as m:
        eos = m.eos
    proc, endpoint = rpc_server()
    try:
        srv, base = start(["--target", long, "--rpc", endpoint, "--mode", "ar", "--exact", "--no-flash-attn",
                           "--kv-type", "f32", "--ctx", "4096", "--parallel", "1"])
    except Exception:
        proc.kill()
        raise
    try:
        body = {"model": "via-edge", "prompt": "Count:", "max_tokens": 4000, "stream": True, "temperature": 0,
                "logit_bias": {str(eos): -100}}  # no early end: the answer runs until the server is killed
        t0 = None
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    proc.send_signal(signal.SIGKILL)  # the server dies with the stream under way
                    proc.wait(10)
                    t0 = time.time()
                    break
            rest = [line for line in lines if line.startswith("data: ")]
        assert t0 is not None and time.time() - t0 < 30
        assert any('"error"' in line and "RPC server" in line for line in rest), rest[-3:]
        health = httpx.get(base + "/health", timeout=10)
        assert srv.poll() is None and health.status_code == 503 and "RPC" in health.json()["rpc"]
        again = httpx.post(base + "/v1/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=30)
        assert again.status_code == 503 and "RPC server" in again.json()["error"]["message"]
    finally:
        srv.terminate()
        srv.wait(10)
        if proc.poll() is None:
            proc.kill()


def cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "via_edge", *args], capture_output=True, text=True, timeout=timeout)


def test_rpc_serve_refuses_a_public_address_without_allow_remote():
    out = cli("rpc-serve", "--host", "0.0.0.0", "--port", str(free_port()))
    assert out.returncode == 2 and "no authentication" in out.stderr and "--allow-remote" in out.stderr
    assert "Traceback" not in out.stderr


def test_nothing_listening_is_one_line_and_exit_2(tiny_target):
    out = cli("generate", "--target", str(tiny_target), "--rpc", f"127.0.0.1:{free_port()}", "--raw", "hi")
    assert out.returncode == 2 and "no RPC server answers" in out.stderr and "Traceback" not in out.stderr
    bad = cli("generate", "--target", str(tiny_target), "--rpc", "nohost", "--raw", "hi")
    assert bad.returncode == 2 and "HOST:PORT" in bad.stderr
    bench = cli("bench", "--pair", "smollm2", "--modes", "ar", "--no-peers", "--categories", "coding", "-n", "2",
                "--rpc", f"127.0.0.1:{free_port()}")
    assert bench.returncode == 2 and "no RPC server answers" in bench.stderr  # bench hands --rpc to the loader


def test_the_prefill_helper_with_rpc_is_one_line_before_anything_loads(tiny_target):
    """The helper is a local copy of all layers: asked for with --rpc it is refused at once."""
    out = cli("generate", "--target", str(tiny_target), "--rpc", f"127.0.0.1:{free_port()}", "--prefill-helper",
              "--raw", "hi")
    assert out.returncode == 2 and "no --rpc" in out.stderr and "Traceback" not in out.stderr


class _OldServer(socketserver.BaseRequestHandler):
    """Answers the hello as a server of protocol 6.0.0 would."""

    def handle(self):
        self.request.recv(1 + 8 + rpc.CAPS)
        self.request.sendall(struct.pack("<QBBBB", 4 + rpc.CAPS, 6, 0, 0, 0) + bytes(rpc.CAPS))


def test_a_protocol_mismatch_is_named(tiny_target):
    with socketserver.TCPServer(("127.0.0.1", 0), _OldServer) as old:
        threading.Thread(target=old.serve_forever, daemon=True).start()
        endpoint = f"127.0.0.1:{old.server_address[1]}"
        with pytest.raises(RemoteDeviceError, match="protocol 6.0.0"):
            rpc.hello(endpoint)
        out = cli("generate", "--target", str(tiny_target), "--rpc", endpoint, "--raw", "hi")
        old.shutdown()
    assert out.returncode == 2 and "protocol 6.0.0" in out.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_rpc_serve_stops_cleanly(sig):
    proc, endpoint = rpc_server()
    proc.send_signal(sig)
    assert proc.wait(10) == 0
    assert "stopped" in proc.stderr.read()
    with pytest.raises(RemoteDeviceError, match="no RPC server answers"):
        rpc.hello(endpoint, timeout=2)


def test_rpc_serve_takes_localhost_and_refuses_ipv6_with_one_line():
    """ggml's server parses numeric IPv4 only: `localhost` is served on 127.0.0.1 (it used to start
    and stop at once), `::1` is refused up front."""
    port = str(free_port())

    def answers() -> bool:
        try:
            rpc.hello(f"127.0.0.1:{port}", timeout=2)
            return True
        except RemoteDeviceError:
            return False

    proc = launch(["rpc-serve", "--host", "localhost", "--port", port, "--threads", 1], answers, "rpc-serve", 30)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    out = cli("rpc-serve", "--host", "::1", "--port", str(free_port()))
    assert out.returncode == 2 and "IPv4 addresses only" in out.stderr and "Traceback" not in out.stderr
