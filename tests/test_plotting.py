"""The report pictures: each plotter writes a PNG from the data shape its report keeps, and without
matplotlib each one says so and writes nothing (the report goes out without its picture)."""

import sys
import warnings

import pytest

from via_edge.bench.load import plot_load
from via_edge.bench.report import plot
from via_edge.tune.report import plot_frontier

PNG = b"\x89PNG\r\n\x1a\n"

BENCH = {"meta": {"prompts": [{"category": "coding"}, {"category": "math"}]},
         "summary": {"ar": {"per_category": {"coding": 1.0, "math": 1.0}, "speedup": 1.0},
                     "via": {"per_category": {"coding": 0.8, "math": 0.6}, "speedup": 0.7,
                             "tier_shares": {"A": 0.5, "B": 0.2, "C": 0.3}}}}
LOAD = {"meta": {"clients": [1, 4]},
        "summary": [{"server": s, "clients": c, "tok_s": 10.0 * c, "tok_s_min": 9.0 * c, "tok_s_max": 11.0 * c,
                     "latency_p50": 2.0, "ttft_p50": 0.3} for s in ("parallel 1", "parallel 4") for c in (1, 4)]}
TUNE = {"meta": {"pair": "tiny", "config": {"fidelity_floor": 0.95}}, "choice": {"mode": "ar"},
        "candidates": [{"mode": "ar", "speedup": 1.0, "fidelity": 1.0, "label": "ar"},
                       {"mode": "via", "speedup": 0.6, "fidelity": 0.9, "label": "via x"}],
        "frontier": ["ar"], "verify": {"ar": {"measured_speedup": 1.0, "measured_agreement": 1.0}}}

PLOTS = [(plot, BENCH), (plot_load, LOAD), (plot_frontier, TUNE)]


@pytest.mark.parametrize("draw,data", PLOTS, ids=["bench", "load", "frontier"])
def test_each_plot_writes_a_png(tmp_path, draw, data):
    path = tmp_path / "fig.png"
    assert draw(data, path)
    assert path.read_bytes()[:8] == PNG


@pytest.mark.parametrize("draw,data", PLOTS, ids=["bench", "load", "frontier"])
def test_without_matplotlib_nothing_is_written(tmp_path, monkeypatch, draw, data):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import raises ImportError
    path = tmp_path / "fig.png"
    assert not draw(data, path)
    assert not path.exists()


def test_bench_plot_of_ar_alone_warns_nothing(tmp_path):
    """`via-edge bench --modes ar` has no bar to compare: the picture is still written, and no
    matplotlib warning about an empty legend reaches the user's terminal."""
    ar_only = {"meta": BENCH["meta"], "summary": {"ar": BENCH["summary"]["ar"]}}
    path = tmp_path / "fig.png"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plot(ar_only, path)
    assert path.read_bytes()[:8] == PNG
