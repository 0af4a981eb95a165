"""The models of one engine: the target loaded at once, the draft and slim when a mode first needs
them (a given file, or derived from the target's own blocks), the target's measured batch
costs and its prompt helper (llama/prefill.py); plus what a catalog pair's tuned choice says to load."""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from .decode.attention import open_measured
from .decode.costs import batch_cost, prompt_helper
from .decode.drafters import check_compatible
from .decode.modes import DEFAULT_MODE, mode_info
from .decode.spec import SpecParams
from .errors import InvalidParameterError
from .llama import LlamaModel, LoadParams
from .llama.prefill import Prefiller
from .tune.store import TunedConfig, load_choice
from .weights import autoformat, catalog, formats
from .weights.formats import build_f32, source_file
from .weights.slim import build_slim, is_prefix, slim_source, target_sha256

Progress = Callable[[str, float], None]  # (what is loading, fraction done)


@dataclass
class Models:
    """The loaded models. `prepare(mode)` loads what a mode needs; until then draft and slim are None."""

    target: LlamaModel
    draft: LlamaModel | None = None
    slim: LlamaModel | None = None
    slim_prefix: int | None = None  # blocks kept, when the slim is a prefix of the target
    batch_cost: Callable[[int], float] | None = None  # the target's verification cost by size (lookup)

    def each(self) -> list[LlamaModel]:
        return [m for m in (self.slim, self.draft, self.target) if m is not None]


def model_file(spec: str | Path, pull_missing: bool = False, f32: bool = False, format: str | None = None,
               load: LoadParams = LoadParams()) -> Path:
    """A model file: a path, or a catalog name (fetched when allowed); its F32 copy with `f32`
    (formats.build_f32), else in the weight format asked for (autoformat.requested: by default the
    automatic one for a catalog name, the file as given for a path)."""
    path = catalog.resolve(spec, pull_missing=pull_missing)
    if f32:
        return build_f32(path)
    name = autoformat.requested(format, explicit_path=not catalog.is_name(spec))
    # the format step times single decodes here, so its own context is small and has no slots or RPC
    measure = replace(load, n_ctx=min(load.n_ctx, 2048), n_seq=1, kv_unified=False, rpc=(), tensor_split=())
    return autoformat.resolve(path, name, measure)[0]


class Loader:
    """Loads an engine's models under one set of load parameters, each once, from any thread."""

    def __init__(self, target: Path, draft: str | Path | None, slim: str | Path | None,
                 draft_layers: str | None, slim_layers: str | None, load: LoadParams, *, f32: bool,
                 pull_missing: bool, progress: Progress | None, format: str | None = None) -> None:
        """`target` is a resolved file (`model_file`); draft and slim are resolved when loaded, a
        catalog draft in `format` (model_file)."""
        self.load, self._f32, self._pull, self._progress = load, f32, pull_missing, progress
        self._format = format
        self._draft, self._draft_layers = draft, draft_layers
        self._slim, self._slim_layers = slim, slim_layers
        self._lock = threading.Lock()  # one thread loads a mode's models
        self.target_path = target
        self.models = Models(self._open_target(target))
        self._attach_prefiller()

    def _open_target(self, path: Path) -> LlamaModel:
        """The target with flash attention as measured faster here unless given (decode/attention.py);
        draft, slim and prefill helper then load with the same setting (the slim and the helper hand
        KV caches to the target, whose layout it sets)."""
        target, self.load = open_measured(path, self.load, lambda params: self._open("target", path, params),
                                          self._measuring("attention"))
        return target

    def _open(self, role: str, path: Path, params: LoadParams | None = None) -> LlamaModel:
        cb = None
        if self._progress is not None:
            cb = lambda frac, role=role: self._progress(role, frac)  # noqa: E731
        # only the target's layers go to RPC servers: draft and slim run here, where they are cheap
        params = params or (self.load if role == "target" else replace(self.load, rpc=(), tensor_split=()))
        return LlamaModel(path, params, progress=cb)

    def _attach_prefiller(self) -> None:
        """Long prompts on the target's unrepacked copy (llama/prefill.py): where asked, or by
        default where repacking is on and the copy decodes prompts faster here (measured once)."""
        p, target = self.load, self.models.target
        if p.prefill_helper is False or p.embeddings or (p.prefill_helper is None and not p.resolved_extra_bufts()):
            return
        if p.rpc or p.capture:
            return
        if p.prefill_helper:  # asked for: for a derived format the shipped file's prompt KV, closer to it
            target.prefiller = Prefiller(target, source_file(target.path))
            return
        target.prefiller = prompt_helper(target, self._measuring("prompt costs"))

    def prepare(self, mode: str, batched: bool) -> None:
        """Load whatever `mode` needs that is not loaded yet. With `batched` (several slots) the
        batch costs are measured whatever the mode: later they would be measured beside (and reset
        the caches of) running generations."""
        info, m = mode_info(mode), self.models
        with self._lock:
            if info.draft_model and m.draft is None:
                m.draft = self._derived("draft", self._draft, self._draft_layers, mode)
            if info.slim and m.slim is None:
                m.slim = self._derived("slim", self._slim, self._slim_layers, mode)
                source = slim_source(m.slim.path)  # KV import only from the very target the slim was cut from
                if source and is_prefix(source[0]) and source[1] == target_sha256(self.target_path):
                    m.slim_prefix = len(source[0])
            if (info.drafter == "lookup" or batched) and m.batch_cost is None:
                m.batch_cost = batch_cost(m.target, self._measuring("batch costs"))  # once per machine and file

    def _measuring(self, what: str) -> Callable[[float], None] | None:
        """The status line's progress of a measurement that runs once per machine and model file
        (called only when it does run, not when it is read back)."""
        return None if self._progress is None else lambda frac: self._progress(what, frac)

    def _derived(self, role: str, given: str | Path | None, layers: str | None, mode: str) -> LlamaModel:
        """The draft or slim: a given file, else a slim of the target's `layers`; checked against it."""
        if given is not None:
            path = model_file(given, self._pull, self._f32, self._format, self.load)
        elif layers:
            path = build_slim(self.target_path, layers)
        else:
            raise InvalidParameterError(f"mode {mode} needs a {role} model (or {role}_layers)")
        model = self._open(role, path)
        check_compatible(self.models.target, model, role)
        return model


def pair_arguments(name: str | None, tuned: bool, overrides: dict, fallback_mode: str = DEFAULT_MODE,
                   **kwargs: Any) -> tuple[str, Path | str, Path | str | None, TunedConfig | None, dict]:
    """What `Engine.from_pair` loads for a catalog pair: (catalog name, target, draft, the tuned
    choice or None, Engine keywords). A tuned choice on this machine supplies the weight formats,
    the mode, the slim layers and each mode's knobs; keywords given win, `overrides` (SpecParams
    fields) change single knobs of every mode's tuned spec, an explicit `spec` replaces them all."""
    pair = catalog.pair(name)
    # a format asked for (flag, Engine argument or VIA_EDGE_FORMAT) wins over the tuned one
    asked = autoformat.requested(kwargs.get("format"), explicit_path=False)
    choice = load_choice(pair["name"]) if tuned else None
    if choice is not None:
        kwargs.setdefault("mode", choice.mode)
        if choice.slim_layers:
            kwargs.setdefault("slim_layers", choice.slim_layers)
        if "spec" not in kwargs:
            mode = kwargs["mode"] if kwargs["mode"] in choice.modes else None
            kwargs["spec"] = replace(choice.spec(mode), **overrides)
            kwargs.setdefault("mode_specs", {m: replace(choice.spec(m), **overrides) for m in choice.modes})
    elif overrides and "spec" not in kwargs:
        kwargs["spec"] = SpecParams(**overrides)
    kwargs.setdefault("mode", fallback_mode)
    kwargs.setdefault("draft_layers", pair.get("draft_layers"))
    kwargs.setdefault("slim_layers", pair.get("slim_layers"))
    target, draft = pair["target"], pair.get("draft")
    if choice is not None and asked == autoformat.AUTO and not kwargs.get("f32"):  # the tuned weight formats
        pull = kwargs.get("pull_missing", False)
        target = formats.derive(catalog.resolve(target, pull_missing=pull), choice.target_format)
        if draft:
            draft = formats.derive(catalog.resolve(draft, pull_missing=pull), choice.draft_format)
        kwargs["format"] = formats.SHIPPED  # the tuned files, as they are
    return pair["target"], target, draft, choice, kwargs
