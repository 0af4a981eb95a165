"""The status line: rewritten in place on a terminal, a handful of whole lines in a log."""

from __future__ import annotations

import io

from via_edge.bench.runner import RunProgress
from via_edge.progress import StatusLine
from via_edge.weights import catalog as models


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_gets_one_line_per_tenth_and_no_carriage_returns():
    log = io.StringIO()
    line = StatusLine(stream=log)
    for i in range(1, 1001):
        line.show(i / 1000, f"step {i}")
    out = log.getvalue()
    assert "\r" not in out
    assert out.splitlines() == ["step 1"] + [f"step {i}" for i in range(100, 1001, 100)]


def test_terminal_rewrites_in_place_throttled_and_ends_the_line():
    term = Terminal()
    line = StatusLine(stream=term, interval=3600.0)
    for i in range(1, 101):
        line.show(i / 100, f"step {i}")
    assert term.getvalue() == "\rstep 1\rstep 100\n"  # the first, then nothing until done
    line.show(1.0, "again")  # an ended line stays ended
    assert term.getvalue().endswith("step 100\n")


def test_line_cut_short_is_closed_on_a_terminal_only():
    term, log = Terminal(), io.StringIO()
    for stream in (term, log):
        line = StatusLine(stream=stream)
        line.show(0.3, "partial")
        line.end()
    assert term.getvalue() == "\rpartial\n"
    assert log.getvalue() == "partial\n"


def test_quiet_writes_nothing():
    log = io.StringIO()
    line = StatusLine(quiet=True, stream=log)
    line.show(0.5, "x")
    line.show(1.0, "y")
    line.end()
    assert log.getvalue() == ""


def test_download_bar_in_a_log_stays_short(capsys):
    bar = models.ByteProgress("file", 1_000_000)
    for _ in range(1000):  # 1000 blocks of 1 kB: once a line per block in a log
        bar.update(1000)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert 2 <= len(lines) <= 11 and lines[-1].startswith("file [") and "100.0%" in lines[-1], lines


def test_bench_progress_in_a_log_ends_on_the_last_run(capsys):
    bar = RunProgress(40, quiet=False)
    for i in range(40):
        bar.step(f"run {i}")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 11 and "40/40 run 39" in lines[-1], lines


def test_a_second_load_of_the_same_role_is_shown_too(capsys):
    from via_edge.cli import load_progress
    for _ in range(2):  # e.g. a model reloaded in one process
        for frac in (0.5, 1.0):
            load_progress("target", frac)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["loading target model  50%", "loading target model 100%"] * 2, lines
