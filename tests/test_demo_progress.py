"""`make demo > log` says what it is doing: off a terminal the demo's progress reporter prints one
line per task every 30 s and when the task completes (a progress bar draws nothing there)."""
from __future__ import annotations

import io

from rich.console import Console

from tidespec.demos import progress


def test_off_a_terminal_a_line_every_interval_and_at_the_end(monkeypatch):
    buf, now = io.StringIO(), [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    with progress.Reporter(Console(file=buf, force_terminal=False, width=200), every_s=30) as report:
        assert not report.live
        for i in range(1, 101):  # one tick a second, 100 s in all
            now[0] = float(i)
            report("bootstrap: teacher-force ShareGPT (tokens)", 1000 * i, 100_000, "")
        report("train (steps)", 3, None, "loss 2.1")  # no total: a first line right away
    task = "bootstrap: teacher-force ShareGPT (tokens)"
    assert buf.getvalue().splitlines() == [  # at t = 1, 31, 61, 91 s, then done at 100 s
        f"{task}: 1,000 / 100,000 (1 %), 0.0 min", f"{task}: 31,000 / 100,000 (31 %), 0.5 min",
        f"{task}: 61,000 / 100,000 (61 %), 1.0 min", f"{task}: 91,000 / 100,000 (91 %), 1.5 min",
        f"{task}: 100,000 / 100,000 (100 %), 1.6 min", "train (steps): 3, 0.0 min; loss 2.1"]


def test_on_a_terminal_it_draws_bars_and_prints_no_lines():
    buf = io.StringIO()
    with progress.Reporter(Console(file=buf, force_terminal=True, width=120)) as report:
        assert report.live
        report("serve (prompts)", 1, 2, "last τ 1.50")
    assert "serve (prompts)" in buf.getvalue()
