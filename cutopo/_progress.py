"""A small progress bar on stderr (no tqdm): ``name |#####     | 120/500 loss 1.23e-03 45 it/s``."""
from __future__ import annotations

import sys
import time

__all__ = ["ProgressBar"]


class ProgressBar:
    """A one-line progress bar redrawn in place on a terminal.

    Parameters
    ----------
    total : int
        The number of updates expected.
    desc : str, optional
        Printed before the bar.
    enabled : bool, optional
        False: nothing is printed (and ``status`` callbacks are never called).
    stream : file, optional
        Default ``sys.stderr``.
    interval : float, optional
        Seconds between redraws on a terminal (default 0.1). Elsewhere (a log file, a pipe)
        a line is written at every tenth of the total instead of redrawing with ``\\r``.

    Notes
    -----
    :meth:`update` takes ``status``, a callable returning the text after the counts (such as
    the current loss): it is called only when the line is drawn, so a caller whose loss
    lives on the GPU pays the host synchronisation of reading it only then.
    """

    def __init__(self, total, desc="", *, enabled=True, stream=None, interval=0.1, width=24):
        self.total, self.desc, self.enabled = max(int(total), 1), desc, enabled
        self.stream = sys.stderr if stream is None else stream
        self.interval, self.width = interval, width
        self.count = 0
        self.start = self.last = time.perf_counter()
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self._next_line = 0                       # the next count to print off a terminal

    def update(self, n=1, status=None):
        """Advance by ``n``; redraw when due (``status() -> str`` is appended)."""
        self.count += n
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            if now - self.last < self.interval and self.count < self.total:
                return
        elif self.count < self._next_line and self.count < self.total:
            return
        self.last = now
        self._next_line = self.count + max(self.total // 10, 1)
        self._draw(now, status)

    def _draw(self, now, status):
        done = min(self.count / self.total, 1.0)
        filled = int(round(done * self.width))
        rate = self.count / max(now - self.start, 1e-9)
        text = (f"{self.desc} |{'#' * filled}{' ' * (self.width - filled)}| "
                f"{self.count}/{self.total}" + (f" {status()}" if status else "")
                + f" {rate:.3g} it/s")
        self.stream.write(("\r" + text + "\x1b[K") if self.tty else text + "\n")
        self.stream.flush()

    def close(self):
        """End the line (on a terminal)."""
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
