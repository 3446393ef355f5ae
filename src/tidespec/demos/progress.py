"""What a long demo step is doing, on a terminal and in a log (`Reporter`).

On a terminal, rich progress bars. Elsewhere (`make demo > log`, CI) a bar never draws, so the same
calls print one line per task at most every `every_s` seconds (30 by default) and when it
completes: "bootstrap: teacher-force ShareGPT (tokens): 41,210 / 100,000 (41 %), 3.2 min".
"""
from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

LOG_EVERY_S = 30.0


class Reporter:
    """A `steps.bootstrap.Progress` callback, `reporter(task, done, total or None, info)`, drawn on a
    terminal or logged (module docstring). Use as a context manager (the bars live inside it)."""

    def __init__(self, console: Console, every_s: float = LOG_EVERY_S):
        self.console, self.every_s = console, every_s
        self.live = console.is_terminal
        self._bars = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                              TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console) \
            if self.live else None
        self._tasks: dict[str, int] = {}
        self._last: dict[str, float] = {}
        self._t0: dict[str, float] = {}

    def __enter__(self) -> Reporter:
        if self._bars is not None:
            self._bars.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._bars is not None:
            self._bars.__exit__(*exc)

    def __call__(self, task: str, done: float, total: float | None = None, info: str = "") -> None:
        now = time.monotonic()
        if self._bars is not None:
            if task not in self._tasks:
                self._tasks[task] = self._bars.add_task(task, total=total, info=info)
            self._bars.update(self._tasks[task], completed=done, total=total, info=info)
            return
        start = self._t0.setdefault(task, now)
        finished = total is not None and done >= total
        if finished or now - self._last.get(task, start - self.every_s) >= self.every_s:
            self._last[task] = now
            of = f" / {total:,.0f} ({100 * done / total:.0f} %)" if total else ""
            self.console.print(f"{task}: {done:,.0f}{of}, {(now - start) / 60:.1f} min{'; ' + info if info else ''}",
                               markup=False, highlight=False)
