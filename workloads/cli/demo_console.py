"""The demo's terminal: its stage lines, the training progress and the summary, and nothing else.

Everything else the demo runs writes to a log file the summary names (WORKDIR/demo.log): the
workloads' own diagnostics (`data: ...`, `eval: ...`, `bench: ...`), the libraries' warnings
(absl, tokenizers, Python's), and the output of every child process, such as the `vllm bench
serve` client's argparse dump, its Triton notices and nanobind's leak report at exit, which once
made up most of a 313-line run. The vLLM server's own log stays in WORKDIR/serve/vllm.log.

The redirection is at the file-descriptor level (fds 1 and 2 point at the log while the demo
runs), so output from C code and from children is caught too, and at the Python level
(sys.stdout, sys.stderr). The terminal is the sys.stdout the demo started with: a duplicate of
fd 1 when it wrote there, else the object itself (a test's capture).
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import sys
import time
from collections.abc import Iterator
from typing import TextIO

LOG_NAME = "demo.log"
_STEP_LINE = re.compile(r"^step (\d+)/(\d+)\s")
# How many training progress lines a run shows at most besides each segment's first and the
# last: a person follows the loss, the log keeps every step.
PROGRESS_LINES = 8
# The trainer's lines that only the log keeps: a stage's start (its end says how long it took),
# and details the summary or the log file name.
_LOG_ONLY = (
    re.compile(r"^stage \S+ started$"),
    re.compile(r"^loading "),
    re.compile(r"^attention: "),
    re.compile(r"^first step: "),
    re.compile(r"^wrote \S+train_summary\.json$"),
)


class Console:
    """Where the demo speaks: the terminal and, with every line, the log.

    Args:
        out: the terminal.
        log: the log file (also fds 1 and 2 while the demo runs).
        started: the demo's start (time.time()), for the elapsed seconds of each line.
    """

    def __init__(self, out: TextIO, log: TextIO, started: float) -> None:
        self.out = out
        self.log = log
        self.started = started
        self._segment_start = True

    def _stamp(self, text: str) -> str:
        return f"[demo {time.time() - self.started:5.1f}s] {text}"

    def say(self, text: str) -> None:
        """A stage line: on the terminal and in the log."""
        line = self._stamp(text)
        self.log.write(line + "\n")
        self.log.flush()
        self.out.write(line + "\n")
        self.out.flush()

    def show(self, text: str) -> None:
        """Text as it is (the summary): on the terminal and in the log."""
        self.log.write(text + "\n")
        self.log.flush()
        self.out.write(text + "\n")
        self.out.flush()

    def note(self, text: str) -> None:
        """A line for the log only."""
        self.log.write(self._stamp(text) + "\n")
        self.log.flush()

    def trainer_say(self, text: str) -> None:
        """The trainer's progress callable: its stage durations and the facts of the run on the
        terminal, the rest in the log."""
        if any(pattern.search(text) for pattern in _LOG_ONLY):
            self.note(text)
        else:
            self.say(text)

    def new_segment(self) -> None:
        """The trainer starts (again): its first step line is shown."""
        self._segment_start = True

    def shows_step(self, step: int, total: int) -> bool:
        """Whether the progress line of `step` goes to the terminal: each segment's first, every
        total/PROGRESS_LINES-th and the last."""
        first, self._segment_start = self._segment_start, False
        every = max(1, total // PROGRESS_LINES)
        return first or step % every == 0 or step == total

    def step_line(self, line: str) -> None:
        """A line the trainer printed to stdout: always in the log, a chosen step on the
        terminal."""
        self.log.write(line)
        self.log.flush()
        match = _STEP_LINE.match(line)
        if match and self.shows_step(int(match.group(1)), int(match.group(2))):
            self.out.write(line)
            self.out.flush()

    def failed(self, exc: BaseException) -> None:
        """The one line pointing at the log when the demo stops on an error."""
        what = type(exc).__name__
        self.say(f"stopped ({what}); the tools' and engines' own output is in {self.log.name}")


class _Stdout(io.TextIOBase):
    """sys.stdout while the demo runs: whole lines to Console.step_line."""

    encoding = "utf-8"

    def __init__(self, console: Console) -> None:
        super().__init__()
        self._console = console
        self._partial = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            self._console.step_line(line + "\n")
        return len(text)

    def flush(self) -> None:
        if self._partial:
            self._console.step_line(self._partial)
            self._partial = ""
        self._console.log.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        # fd 1 is the log while the demo runs: a child handed sys.stdout writes there too.
        return 1


def _terminal(stream: TextIO) -> tuple[TextIO, bool]:
    """The terminal to keep: a new file on a duplicate of fd 1 or 2 when `stream` writes there
    (those fds are about to point at the log), else `stream` itself. The flag: whether it is
    a new file (closed afterwards)."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError, io.UnsupportedOperation):
        return stream, False
    if fd not in (1, 2):
        return stream, False
    stream.flush()
    return os.fdopen(os.dup(fd), "w", buffering=1, encoding="utf-8", errors="replace"), True


@contextlib.contextmanager
def captured(log_path: pathlib.Path, started: float) -> Iterator[Console]:
    """Runs the body with fds 1 and 2, sys.stdout and sys.stderr on `log_path` (appended);
    yields the Console that still reaches the terminal. An error leaves one line on the
    terminal naming the log, then propagates."""
    sys.stdout.flush()
    sys.stderr.flush()
    out, owned = _terminal(sys.stdout)
    log = log_path.open("a", buffering=1, encoding="utf-8", errors="replace")
    console = Console(out, log, started)
    saved = (os.dup(1), os.dup(2))
    old = (sys.stdout, sys.stderr)
    try:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = _Stdout(console)
        sys.stderr = log
        yield console
    except BaseException as exc:
        console.failed(exc)
        raise
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        sys.stdout, sys.stderr = old
        log.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        log.close()
        if owned:
            out.close()
