"""The command line as a user meets it: real llama.cpp, tiny models; a few runs in processes of
their own (as a user starts them), the rest through the same entry point in this process."""

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from via_edge import Engine, SpecParams
from via_edge.cli.app import main

EXACT_FLAGS = ["--exact", "--no-flash-attn", "--kv-type", "f32", "--ctx", "256"]


def in_process(args) -> subprocess.CompletedProcess:
    """`via-edge ARGS` through `main()`, the console script's entry point, in this process: its
    output, and the exit code it would end with."""
    out, err, argv = io.StringIO(), io.StringIO(), sys.argv
    sys.argv = ["via-edge", *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def cli(*args, ok=True, process=False):
    """With `process`, in a Python process of its own (`python -m via_edge`)."""
    args = [str(a) for a in args]
    proc = subprocess.run([sys.executable, "-m", "via_edge", *args], capture_output=True, text=True,
                          timeout=120) if process else in_process(args)
    assert "Traceback" not in proc.stderr, proc.stderr
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


def user_error(*args, match):
    proc = cli(*args, ok=False)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert match in proc.stderr, proc.stderr
    return proc


@pytest.mark.parametrize("mode", ["ar", "sd", "via", "hier", "lookup"])
def test_generate_json(tiny_target, mode):
    proc = cli("generate", "hello world", "--target", tiny_target, "--draft-layers", "0-1",
               "--slim-layers", "0-2", "--mode", mode, "-n", 20, "--raw", "--json", *EXACT_FLAGS, process=True)
    out = json.loads(proc.stdout)
    # the same request in this process (same exact kernels) is the oracle for what the command reports
    spec = SpecParams()
    with Engine(tiny_target, draft_layers="0-1", slim_layers="0-2", mode=mode, n_ctx=256, kv_type="f32",
                flash_attn=False, use_extra_bufts=False) as engine:
        ref = engine.generate("hello world", max_tokens=20, chat_template=False, spec=spec)
        prompt_n = len(engine.tokens_for("hello world", False))
    assert out["mode"] == mode and out["tokens"] == ref.tokens and out["text"] == ref.text
    assert out["prefill_helper"] is False  # --exact: no repacking, nothing for a copy to gain
    assert out["timings"]["predicted_n"] == len(ref.tokens) and out["timings"]["prompt_n"] == prompt_n
    assert out["timings"]["draft_n"] == ref.stats.draft_n and out["tiers"] == ref.tiers
    # llama-server's count: the tokens after the first (it comes with the prompt) over the same span
    t = out["timings"]
    assert t["predicted_per_second"] == pytest.approx((t["predicted_n"] - 1) / t["predicted_ms"] * 1e3, rel=1e-3)
    if mode in ("sd", "via", "hier"):  # prompt lookup finds nothing to copy in random text
        assert ref.stats.draft_n > 0


def test_generate_says_when_the_prefill_helper_decodes_prompts(tiny_target):
    """Asked for, the copy decodes the (long) prompt; the answer is the one without it (same kernels
    on the tiny F32 model), and --json and the status line say which ran: a short prompt stays
    on the target though the copy is loaded."""
    prompt = " ".join(f"w{i % 37}" for i in range(40))
    got = {flag: json.loads(cli("generate", prompt, "--target", tiny_target, "--mode", "ar", "-n", 12, "--raw",
                                "--json", *EXACT_FLAGS, flag).stdout)
           for flag in ("--prefill-helper", "--no-prefill-helper")}
    assert got["--prefill-helper"]["prefill_helper"] is True and got["--no-prefill-helper"]["prefill_helper"] is False
    assert got["--prefill-helper"]["tokens"] == got["--no-prefill-helper"]["tokens"]
    helped = got["--prefill-helper"]["timings"]
    assert helped["prompt_n"] >= 64 and helped["prompt_helped_n"] == helped["prompt_n"]
    assert got["--no-prefill-helper"]["timings"]["prompt_helped_n"] == 0
    status = {p: cli("generate", p, "--target", tiny_target, "--mode", "ar", "-n", 4, "--raw", *EXACT_FLAGS,
                     "--prefill-helper").stderr for p in (prompt, "w1 w2 w3")}
    assert "tok/s on the prefill helper)" in status[prompt]
    assert "prefill helper" not in status["w1 w2 w3"] and "tok/s)" in status["w1 w2 w3"]


def test_generate_streams_text_and_reports(tiny_target):
    proc = cli("generate", "hello world", "--target", tiny_target, "--draft-layers", "0-1", "--mode", "sd",
               "-n", 12, *EXACT_FLAGS, process=True)
    assert proc.stdout.strip() and "[sd, shipped] " in proc.stderr and "tok/s" in proc.stderr


def test_bad_input_gives_one_clear_message(tiny_target, tmp_path):
    foreign = tmp_path / "foreign.gguf"
    foreign.write_text("hello")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_target.read_bytes()[:5000])
    base = ["generate", "hi", "--raw"]
    user_error(*base, "--target", tmp_path / "missing.gguf", match="model file not found")
    user_error(*base, "--target", foreign, match="not a GGUF")
    user_error(*base, "--target", cut, match="truncated")
    user_error(*base, "--target", "no-such-model", match="unknown model 'no-such-model'")
    user_error(*base, "--pair", "no-such-pair", match="unknown pair")
    proc = user_error("generate", "word " * 400, "--target", tiny_target, *EXACT_FLAGS, match="context window")
    assert "--ctx" in proc.stderr  # the flag that raises it, not llama.cpp's name
    user_error(*base, "--target", tiny_target, "--temperature", "-1", match="temperature must be")
    user_error(*base, "--target", tiny_target, "--top-p", "0", match="top_p")
    user_error(*base, "--target", tiny_target, "--mode", "fast", match="mode must be one of")
    user_error(*base, "--target", tiny_target, "--mode", "via", "--slim-layers", "0-9",
               "--draft-layers", "0-1", match="out of range")
    user_error(*base, "--target", tiny_target, "--tau-accept", "1.5", match="tau_accept")
    user_error(*base, "--target", tiny_target, "--max-tokens", "0", match="--max-tokens must be in 1..")


@pytest.mark.parametrize("option,value", [("--ctx", -5), ("--ctx", 0), ("--threads", 0), ("--gpu-layers", -3),
                                          ("--max-tokens", -1)])
def test_numeric_options_are_checked_before_loading(tiny_target, option, value):
    """Checked up front with the range in the message, before any model loads (so a missing model
    file is not even looked at)."""
    proc = user_error("generate", "hi", "--target", "/nonexistent/model.gguf", option, value,
                      match=f"{option} must be")
    assert str(value) in proc.stderr and "not found" not in proc.stderr


@pytest.mark.parametrize("args,match", [
    (["--slim-layers", "5-2", "--mode", "via"], "runs backwards"),
    (["--draft-layers", "0-x"], "bad layer range"),
    (["--seed", "-3"], "seed must be >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--temperature", "nan"], "temperature must be"),
    (["--n-draft", "0"], "n_draft must be in 1..64"),
    (["--kv-type", "q3"], "kv_type must be one of f32, f16, q8_0, got 'q3'"),
])
def test_layer_sets_sampling_and_knobs_are_checked_before_loading(args, match):
    """The model path does not exist: a check made after loading would report that instead."""
    proc = user_error("generate", "hi", "--target", "/nonexistent/model.gguf", *args, match=match)
    assert "not found" not in proc.stderr


def test_an_unknown_model_source_names_the_valid_ones(tmp_path):
    env = {**os.environ, "VIA_EDGE_SOURCES": "pipy", "VIA_EDGE_MODEL_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "via_edge", "models", "pull", "qwen2.5-coder-0.5b-instruct"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "unknown source 'pipy'; use huggingface, pypi" in proc.stderr


def run_read_only(dirs, argv, env):
    """`argv` with `dirs` read-only: by permissions for a user, by a read-only bind mount in a
    private mount namespace for root (whom permissions do not stop)."""
    if os.geteuid() != 0:
        for d in dirs:
            d.chmod(0o555)
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
        finally:
            for d in dirs:
                d.chmod(0o755)
    mounts = " && ".join(f"mount --bind '{d}' '{d}' && mount -o remount,ro,bind '{d}' '{d}'" for d in dirs)
    return subprocess.run(["unshare", "-m", "sh", "-c", mounts + ' && exec "$@"', "sh", *argv],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("command", [["generate", "hi", "--raw", "--mode", "via", "--slim-layers", "0-2",
                                      "--draft-layers", "0-1", *EXACT_FLAGS],
                                     ["models", "pull", "qwen2.5-coder-0.5b-instruct"]])
def test_a_read_only_model_directory_is_one_clear_message(tiny_target, tmp_path, command):
    """The target sits in a read-only folder, so derived slims go to the model directory, which
    is read-only too: one line naming it and exit 2 (it was a traceback, or for a pull "not
    enough disk space")."""
    shipped, models = tmp_path / "shipped", tmp_path / "models"
    shipped.mkdir()
    models.mkdir()
    target = shipped / "target.gguf"
    target.write_bytes(tiny_target.read_bytes())
    if command[0] == "generate":
        command = [*command, "--target", str(target)]
    env = {**os.environ, "VIA_EDGE_MODEL_DIR": str(models)}
    proc = run_read_only([shipped, models], [sys.executable, "-m", "via_edge", *command], env)
    if "unshare" in proc.stderr and "Traceback" not in proc.stderr:
        pytest.skip(f"no private mount namespace here: {proc.stderr.strip()}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{models} is read-only" in proc.stderr and "VIA_EDGE_MODEL_DIR" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 3, proc.stderr


def test_long_prompts_from_stdin_and_file(tiny_target, tmp_path):
    """Prompts past the OS argument limit (128 KiB) come from - (standard input) or --prompt-file."""
    text = "hello world " * 12000  # 144 KB: too long for argv, and for the 256-token context
    f = tmp_path / "p.txt"
    f.write_text(text)
    for args, stdin in ((["-"], text), (["--prompt-file", f], None)):
        proc = subprocess.run([sys.executable, "-m", "via_edge", "generate", *map(str, args), "--target",
                               str(tiny_target), "--raw", *EXACT_FLAGS], input=stdin, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and "context window holds 256" in proc.stderr, proc.stderr
    short = tmp_path / "short.txt"
    short.write_text("hello world")
    a = cli("generate", "--prompt-file", short, "--target", tiny_target, "--raw", "-n", 8, "--json", *EXACT_FLAGS)
    b = subprocess.run([sys.executable, "-m", "via_edge", "generate", "-", "--target", str(tiny_target), "--raw",
                        "-n", "8", "--json", *EXACT_FLAGS], input="hello world", capture_output=True, text=True)
    c = cli("generate", "hello world", "--target", tiny_target, "--raw", "-n", 8, "--json", *EXACT_FLAGS)
    assert json.loads(a.stdout)["tokens"] == json.loads(b.stdout)["tokens"] == json.loads(c.stdout)["tokens"]
    user_error("generate", "--target", tiny_target, match="no prompt")
    user_error("generate", "--prompt-file", tmp_path / "nope.txt", "--target", tiny_target, match="cannot read")


def test_help_keeps_the_tuned_default_notes():
    out = " ".join(cli("generate", "--help").stdout.replace("│", " ").split())  # the help box's borders out
    for note in ("(default: tuned, else lookup)", "(default: tuned, else 6)", "(default: tuned, else 0.9)",
                 "(default: tuned, else the catalog's)"):
        assert note in out, note


def test_incompatible_draft_is_refused(tiny_target, tiny_dir):
    from conftest import make_tiny_gguf

    other = make_tiny_gguf(tiny_dir / "cli-other.gguf", blocks=1, seed=2, extra_tokens=4)
    user_error("generate", "hi", "--target", tiny_target, "--draft", other, "--mode", "sd", *EXACT_FLAGS,
               match="EOS token differs")


def test_models_help_names_only_commands_that_exist():
    out = cli("models", "--help").stdout
    for command in ("list", "pull", "path", "verify", "optimize", "rm", "prune"):
        assert command in out
    assert "fetch" not in out and "locate" not in out


def test_models_commands(tmp_path, monkeypatch):
    monkeypatch.setenv("VIA_EDGE_MODEL_DIR", str(tmp_path))
    out = cli("models", "list", process=True).stdout
    assert "qwen2.5-coder-1.5b-instruct" in out and "pair qwen2.5-coder" in out
    assert cli("models", "path", "smollm2-135m-instruct").stdout.strip().endswith(".gguf")
    user_error("models", "path", "qwen2.5-coder-1.5b-instruct", match="not downloaded")
    user_error("models", "pull", "nope", match="unknown model")


def test_slim_build(tiny_target, tmp_path):
    out = tmp_path / "s.gguf"
    assert cli("slim", "build", tiny_target, "--layers", "0-1", "--out", out).stdout.strip() == str(out)
    assert out.exists()
    user_error("slim", "build", tiny_target, "--layers", "3,1", match="increasing")
