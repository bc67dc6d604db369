"""Progress output on stderr that stays out of logs and pipes.

Animated output (a bar redrawn in place, a ticking clock) is only drawn on a terminal,
or when the caller asks for it with ``progress=True``: carriage-return redraws turn into
thousands of lines in a CI log or a file. A few plain lines (what is being built, how
long it took) are fine anywhere.
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import Any, TextIO

__all__ = ["Heartbeat", "StepReporter", "progress_bar", "wants_progress"]


def wants_progress(progress: bool | None, stream: TextIO | None = None) -> bool:
    """``progress`` when given; when None, whether ``stream`` (default stderr) is a terminal."""
    if progress is not None:
        return bool(progress)
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


class _SimpleBar:
    """A text progress bar on stderr for when tqdm is not installed."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n = total, desc, 0

    def set_description(self, desc: str) -> None:
        self.desc = desc

    def set_postfix_str(self, text: str) -> None:
        self.desc = text

    def update(self, k: int = 1) -> None:
        self.n += k
        done = int(30 * self.n / max(self.total, 1))
        sys.stderr.write(f"\r{self.desc} [{'#' * done}{'.' * (30 - done)}] "
                         f"{self.n}/{self.total}")
        sys.stderr.flush()

    def write(self, msg: str, file: TextIO | None = None) -> None:
        (file or sys.stderr).write(f"\r{msg}\x1b[K\n")

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


def progress_bar(total: int, desc: str, enabled: bool | None = True, unit: str = "run") -> Any:
    """A progress bar on stderr (tqdm's when installed, a plain one otherwise), or None.

    ``enabled``: True draws it, False does not, None draws it only when stderr is a
    terminal.
    """
    if not wants_progress(enabled):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return _SimpleBar(total, desc)
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)


class StepReporter:
    """Tells the user what a long job is doing: one line per step, ``[2/5] exporting``.

    With ``live`` (default: stderr is a terminal) it is a single line redrawn in place with
    the seconds elapsed, ticking even while one step runs for a long time (an ONNX export
    can take half a minute). Without, each step is a plain line, so logs show progress too,
    and a step that runs on with nothing written for ``quiet_s`` seconds gets a line saying
    so (``[5] timing ...: still running, 25 s``, with what :meth:`update` last said): a
    user reading a pipe sees within seconds that the job is alive, a log gets one line per
    ``quiet_s`` at most. Use as a context manager; :meth:`done` writes the final line.
    ``steps`` 0: not known in advance (steps are then numbered without a total).
    """

    quiet_s = 5.0

    def __init__(self, title: str, steps: int, live: bool | None = None,
                 stream: TextIO | None = None):
        self.title, self.steps = title, steps
        self.stream = sys.stderr if stream is None else stream
        self.live = wants_progress(live, self.stream)
        self.t0 = time.perf_counter()
        self.k, self.text = 0, "starting"
        self._step_text, self._step_t0 = "", self.t0
        self._last_line = self.t0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StepReporter:
        self._thread = threading.Thread(target=self._tick if self.live else self._heartbeat,
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None and self.k and not self._stop.is_set():
            # Only after a step was announced: a check failing before any (a bad option)
            # stays the one error line.
            self.done(f"failed after {self.elapsed():.0f} s")
        self._halt()

    def elapsed(self) -> float:
        """Seconds since the reporter was made."""
        return time.perf_counter() - self.t0

    def step(self, text: str) -> None:
        """Start the next step, described by ``text``."""
        with self._lock:
            self.k += 1
            self.text = self._step_text = text
            self._step_t0 = time.perf_counter()
            if self.live:
                self._draw()
            else:
                self._line(f"{self.title}: {self._count()} {text}")

    def update(self, text: str) -> None:
        """Say how the current step is going (``calibrating 3/16``): redrawn on a terminal;
        in a pipe the next "still running" line quotes it."""
        with self._lock:
            self.text = text
            if self.live:
                self._draw()

    def done(self, text: str) -> None:
        """Finish with one final line ``title: text``."""
        self._halt()
        with self._lock:
            if self.live:
                self.stream.write("\r\x1b[K")
            self._line(f"{self.title}: {text}")

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _line(self, msg: str) -> None:
        self.stream.write(msg + "\n")
        self.stream.flush()
        self._last_line = time.perf_counter()

    def _count(self) -> str:
        return f"[{self.k}/{self.steps}]" if self.steps else f"[{self.k}]"

    def _draw(self) -> None:
        self.stream.write(f"\r{self.title}: {self._count()} {self.text} "
                          f"({self.elapsed():.0f} s)\x1b[K")
        self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                if not self._stop.is_set():
                    self._draw()

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(0.5, self.quiet_s / 4)):
            with self._lock:
                now = time.perf_counter()
                if self._stop.is_set() or not self.k or now - self._last_line < self.quiet_s:
                    continue
                doing = self._step_text
                if self.text != doing:  # what update() said of the step
                    doing += f" ({self.text})"
                self._line(f"{self.title}: {self._count()} {doing}: still running, "
                           f"{now - self._step_t0:.0f} s")


class Heartbeat:
    """Where no bar is drawn (a pipe, a log): a line every ``every`` seconds while a long
    job runs, ``kiln bench: round 12/55, 30 s``, with what :meth:`update` last said, and
    nothing at all for a job done sooner (its output stays what it was). A context
    manager; ``enabled`` False makes it do nothing."""

    def __init__(self, title: str, every: float = 5.0, enabled: bool = True,
                 stream: TextIO | None = None):
        self.title, self.every, self.enabled = title, every, enabled
        self.stream = sys.stderr if stream is None else stream
        self.text = "running"
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Heartbeat:
        if self.enabled:
            self._thread = threading.Thread(target=self._beat, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def update(self, text: str) -> None:
        """What the job is at (``round 12/55``), for the next line."""
        self.text = text

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            self.stream.write(f"{self.title}: {self.text}, "
                              f"{time.perf_counter() - self.t0:.0f} s\n")
            self.stream.flush()
