"""Fill-in-the-middle prompts: the tokens an editor's completion asks for, laid out as llama-server's
`/infill` lays them out, so editor plugins written for it (llama.vim, llama.vscode) and OpenAI's
`suffix` on /v1/completions (Continue and others) get what the model was trained on.

    [FIM_REP]myproject\\n [FIM_SEP]name\\n extra text ... [FIM_SEP]filename\\n      (repo-level, when the
    [FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID]                         model has those tokens)

The prefix keeps its end and the suffix its beginning (at most 3/4 and 1/4 of llama-server's
default batch, as it takes them); the extra chunks fill what room the context has left, oldest
dropped first. `suffix` on a completion is llama-cpp-python's plain [PRE] prefix [SUF] suffix
[MID], as its `create_completion(suffix=...)` builds it. Copy drafting reads the whole prompt, so a completion that repeats the suffix or a
chunk of the extra context is drafted from it.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..errors import InvalidParameterError
from ..llama import LlamaModel

REPO = "myproject\n"  # llama-server's repository name: the models were trained with one there
FILE = "filename\n"   # ... and its name for the file being edited
BATCH = 2048          # llama-server's default batch, which its prefix and suffix budgets are shares of


def check_fim(model: LlamaModel, field: str) -> None:
    missing = [k for k in ("pre", "suf", "mid") if k not in model.fim]
    if missing:
        raise InvalidParameterError(f"'{field}' needs a model trained for fill-in-the-middle, and {model.path.name} "
                                    f"has no FIM {'/'.join(missing)} token (Qwen2.5-Coder, StarCoder, CodeLlama "
                                    "and Codestral have them)", field)


def extra_chunks(value: Any) -> list[tuple[str, str]]:
    """`input_extra`: a list of {"filename": str, "text": str} (filename optional)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(
            isinstance(c, Mapping) and isinstance(c.get("text"), str) and isinstance(c.get("filename", ""), str)
            for c in value):
        raise InvalidParameterError("'input_extra' must be a list of {\"filename\": ..., \"text\": ...} objects",
                                    "input_extra")
    return [(c.get("filename") or "tmp", c["text"]) for c in value]


def infill_tokens(model: LlamaModel, prefix: str, suffix: str, extra: Sequence[tuple[str, str]] | None = None,
                  prompt: str = "", n_predict: int = 256, field: str = "input_suffix") -> list[int]:
    """The fill-in-the-middle prompt for the gap between `prefix` and `suffix` (`prompt`: the
    start of the middle, already typed); `field` names what asked for it in the refusal.

    With `extra` (a list, even empty: /infill) the layout and budgets are llama-server's; without
    (`suffix` on a completion) the prompt is llama-cpp-python's: [PRE] prefix [SUF] suffix [MID],
    nothing cut (a prompt too long for the context is refused by the engine).
    """
    check_fim(model, field)
    fim = model.fim

    def tok(text: str) -> list[int]:
        return model.tokenize(text, add_special=False, parse_special=False) if text else []

    pre, head, suf = tok(prefix), tok(prompt), tok(suffix)
    bos = [model.bos] if model.add_bos else []
    if extra is None:
        return bos + [fim["pre"]] + pre + head + [fim["suf"]] + suf + [fim["mid"]]
    repo: list[int] = [fim["rep"]] + tok(REPO) if "rep" in fim else []
    for name, text in extra:
        repo += ([fim["sep"]] + tok(name + "\n")) if "sep" in fim else tok("\n\n--- snippet ---\n\n")
        repo += tok(text)
    if "sep" in fim:
        repo += [fim["sep"]] + tok(FILE)
    n_batch = min(BATCH, model.n_ctx)
    pre = pre[len(pre) - min(len(pre), 3 * (n_batch // 4)):]
    suf = suf[:max(0, min(len(suf), n_batch // 4 - (2 + len(head))))]
    room = max(0, model.n_ctx - n_batch - 2 * n_predict)
    return (repo[len(repo) - min(room, len(repo)):] if room else []) + bos + [fim["pre"]] + pre + head + \
        [fim["suf"]] + suf + [fim["mid"]]


STOP_TYPE = {"stop": "eos", "length": "limit"}


def as_llama_server(out: dict) -> dict | None:
    """An OpenAI completion (or streamed chunk) as llama-server's /infill answers: `content`,
    `stop`, and on the last one its `timings` and counts. The usage chunk has no counterpart."""
    if not out.get("choices"):
        return None
    choice = out["choices"][0]
    shaped = {"content": choice.get("text") or "", "stop": choice["finish_reason"] is not None, "model": out["model"]}
    if shaped["stop"]:
        timings = out.get("timings") or {}
        shaped |= {"stop_type": STOP_TYPE.get(choice["finish_reason"], choice["finish_reason"]),
                   "tokens_predicted": timings.get("predicted_n"), "tokens_evaluated": timings.get("prompt_n"),
                   "tokens_cached": timings.get("cache_n"), "truncated": False, "timings": timings}
    return shaped
