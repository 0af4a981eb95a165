"""`via-edge chat` through a real pseudo-terminal (pexpect)."""

import sys

import pexpect

from conftest import interruptible


def spawn(*args, timeout=60):
    child = pexpect.spawn(sys.executable, ["-m", "via_edge", "chat", *map(str, args)], encoding="utf-8",
                          preexec_fn=interruptible,
                          timeout=timeout)
    child.expect("/help for commands")
    child.expect_exact("> ")
    return child


def test_two_turns_stats_mode_and_history(tiny_target):
    child = spawn("--target", tiny_target, "--draft-layers", "0-1", "--slim-layers", "0-2", "--exact", "--kv-type", "f32",
                  "--no-flash-attn", "--ctx", "96", "-n", "24", "--show-tiers", "--mode", "sd")
    child.sendline("hello there")
    child.expect("\033\\[(32|34)m")  # coloured by origin
    child.expect_exact("> ")
    child.sendline("and a second turn")
    child.expect_exact("> ")
    child.sendline("/stats")
    child.expect(r"\[mode sd\] (\d+) tokens at")
    assert int(child.match.group(1)) > 0
    child.expect_exact("> ")
    child.sendline("/mode via")
    child.expect_exact("[mode via]")
    child.expect_exact("> ")
    dropped = False  # llama.cpp pads n_ctx to 256 tokens: a few more turns fill it
    for turn in range(8):
        child.sendline(f"turn {turn}: a longer message that fills the small context window quickly")
        dropped = child.expect_exact(["[oldest turns dropped", "> "]) == 0
        if dropped:
            child.expect_exact("> ")
            break
    assert dropped
    child.sendline("/nonsense")
    child.expect_exact("unknown command /nonsense")
    child.expect_exact("> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_the_answer_and_keeps_the_session(smollm2):
    child = spawn("--target", smollm2, "--mode", "ar", "-n", "3000")
    ask = "Write a very long essay about the history of computers, with many sections."
    child.sendline(ask)
    child.expect_exact(ask + "\r\n")  # the terminal's echo of the question
    child.expect(r"\w+ \w+ \w+")  # the answer is streaming
    child.sendintr()
    child.expect_exact("[stopped]", timeout=10)
    child.expect_exact("> ")
    child.sendline("/stats")
    child.expect(r"(\d+) tokens at")
    assert 0 < int(child.match.group(1)) < 3000
    child.expect_exact("> ")
    child.sendeof()  # Ctrl-D quits cleanly
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_a_message_too_long_for_the_context_keeps_the_session(tiny_target):
    child = spawn("--target", tiny_target, "--exact", "--kv-type", "f32", "--no-flash-attn", "--ctx", "256",
                  "-n", "16", "--mode", "ar")
    child.sendline("a first short question")
    child.expect_exact("> ")
    child.sendline("long " * 600)  # far beyond the 256-token context
    child.expect_exact("[not sent: that message is")
    child.expect_exact("The conversation so far is kept.]")
    child.expect_exact("> ")
    child.sendline("/stats")
    child.expect(r"\[mode ar\] (\d+) tokens at")  # the first answer is still counted: same session
    assert int(child.match.group(1)) > 0
    child.expect_exact("> ")
    child.sendline("and a short one again")
    assert child.expect_exact(["[oldest turns dropped", "> "]) == 1  # the history still fits
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_in_a_command_says_what_it_stopped(smollm2):
    child = pexpect.spawn(sys.executable, ["-m", "via_edge", "generate", "Write a very long essay about computers.",
                                           "--target", str(smollm2), "-n", "3000", "--mode", "ar"], encoding="utf-8",
                          timeout=60, preexec_fn=interruptible)  # ar: lookup copies SmolLM2's repetitions
    child.expect(r"\w+ \w+ \w+")  # generating
    child.sendintr()
    child.expect_exact("interrupted: generation stopped; the answer so far is above; nothing was written to disk")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130
