"""Progress of long work on stderr: a tqdm bar on a terminal, else one plain line every `interval` seconds and
one at the end, so a log file, CI or `nohup` sees where a run stands.

`enabled`: None picks by the stream (bar on a terminal, lines elsewhere), True forces the bar, False shows
nothing. `interval` 0 writes a line at every update. A line reads

    train: step 120/800 (15%) | loss 1.2345 | 1234 tokens/s | elapsed 1m02s | ETA 5m12s | RSS 1.23 GiB

with the caller's fields between the count and the times, and the GPU's peak allocated memory after RSS
when CUDA is in use.
"""

from __future__ import annotations

import math
import sys
import time
from typing import IO, Any, Callable, Optional

from juno_py.metrics import format_bytes, rss_bytes

DEFAULT_INTERVAL = 10.0  # seconds between two progress lines when stderr is not a terminal


def format_duration(seconds: float) -> str:
    """3 s, 5m12s, 2h03m."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def memory_text() -> str:
    """RSS now, and the GPU's peak allocated memory where CUDA has been used."""
    text = f"RSS {format_bytes(rss_bytes())}"
    torch = sys.modules.get("torch")  # only when the caller already uses torch: never imported for this
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        text += f" | GPU {format_bytes(torch.cuda.max_memory_allocated())}"
    return text


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Progress:
    """Counts units of work (`update(n)`); see the module docstring for what is shown where."""

    def __init__(
        self,
        total: Optional[float],
        desc: str,
        unit: str = "step",
        initial: float = 0,
        enabled: Optional[bool] = None,
        interval: float = DEFAULT_INTERVAL,
        stream: Optional[IO[str]] = None,
        count: Optional[Callable[[float], str]] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total, self.desc, self.unit = total, desc, unit
        self.n = initial
        self.stream = stream if stream is not None else sys.stderr
        self.interval = max(0.0, float(interval))
        self.count = count or (lambda v: f"{v:g}")
        self.clock = clock
        self.fields = ""
        self._start_n = initial
        self._started = clock()
        self._last_line: Optional[float] = None
        self._line_n: Optional[float] = None
        self._closed = False
        terminal = _is_terminal(self.stream)
        self.mode = "off" if enabled is False else "bar" if (enabled or terminal) else "lines"
        self._bar: Any = None
        if self.mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(
                total=total,
                initial=initial,
                file=self.stream,
                unit=unit,
                dynamic_ncols=True,
                desc=desc,
                unit_scale=count is not None,
                unit_divisor=1024 if unit == "B" else 1000,
            )

    def update(self, n: float = 1, fields: Optional[str] = None) -> None:
        """`n` more units done; `fields`: the caller's numbers of this moment ("loss 1.23 | 456 tokens/s")."""
        self.n += n
        if fields is not None:
            self.fields = fields
        if self._bar is not None:
            self._bar.update(n)
            self._bar.set_postfix_str(
                f"{self.fields} | {memory_text()}" if self.fields else memory_text(), refresh=False
            )
        elif self.mode == "lines":
            now = self.clock()
            if now - (self._last_line if self._last_line is not None else self._started) >= self.interval:
                self._write(now)

    def elapsed(self) -> float:
        """Seconds since the work began."""
        return self.clock() - self._started

    def line(self, now: Optional[float] = None) -> str:
        now = self.clock() if now is None else now
        elapsed = now - self._started
        where = f"{self.unit} {self.count(self.n)}"
        eta = ""
        if self.total:
            where += f"/{self.count(self.total)} ({100 * self.n / self.total:.0f}%)"
            done = self.n - self._start_n
            left = self.total - self.n
            eta = f" | ETA {format_duration(elapsed * left / done) if done > 0 else '?'}"
        fields = f" | {self.fields}" if self.fields else ""
        return f"{self.desc}: {where}{fields} | elapsed {format_duration(elapsed)}{eta} | {memory_text()}"

    def _write(self, now: float) -> None:
        self._last_line, self._line_n = now, self.n
        print(self.line(now), file=self.stream, flush=True)

    def close(self, aborted: bool = False) -> None:
        """End the bar, or write the last line (unless the latest line already shows the end); `aborted`: the
        work failed, and its error message is what stderr should end with, so no last line."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self.mode == "lines" and self._line_n != self.n and not aborted:
            self._write(self.clock())

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(aborted=exc_type is not None)
