"""The errors a run stops with in one line, each with its exit code (the table in
docs/faults.md), and the `error:` line every entry point prints: one line on the screen,
whatever the message quotes. A value typed or pasted by mistake (100 KB of digits, a
file's contents) is shown by its start, its end and its length; newlines are folded.
Importing this module imports nothing of the project's and changes nothing."""

from __future__ import annotations

import re
import sys
from typing import NoReturn


class OneLineError(Exception):
    """A fault the program reports as one `error:` line and exits with `exit_code`."""

    exit_code = 1


class BadInputError(OneLineError):
    """What the user gave cannot run (a config, the data, the workdir, the launch):
    exit code 2. The message names the field or path, the value and the fix."""

    exit_code = 2


class ConfigError(BadInputError, ValueError):
    """A bad config value, or fields that do not fit each other, the devices or the data."""


class WorkdirError(BadInputError):
    """The workdir cannot hold the run (in use, not writable, full, its record damaged)."""


class DatasetNotPreparedError(BadInputError):
    """Which dataset, where it was looked for, the command that prepares it."""


class DatasetChangedError(DatasetNotPreparedError):
    """`prepare` refuses to reuse the prepared copy of an image folder that has changed."""


class UnreadableImageError(BadInputError, ValueError):
    """A record whose encoded image cannot be decoded (a truncated or mislabelled file)."""


class LaunchError(BadInputError, ValueError):
    """The environment cannot start this run as it is (what, and the fix)."""


class NonFiniteLossError(OneLineError, RuntimeError):
    """An update was not finite (loss, gradient or updated state) and skip_nonfinite is
    off: exit code 1; the message names the step and the checkpoints kept."""

    exit_code = 1

    def __init__(self, step: int, epoch: float, message: str = ""):
        super().__init__(message or f"non-finite loss, gradient or update at step {step}")
        self.step, self.epoch = step, epoch


class RunInterruptedError(OneLineError):
    """SIGINT (Ctrl-C) stopped the run after the in-flight checkpoint save finished: exit
    code 130; the message names the checkpoints kept."""

    exit_code = 130


# A word (a run without spaces: a value, a path, a flag with its value) longer than this
# is cut; the longest real ones (a workdir's path, a coordinator address) are far shorter.
LONGEST_WORD = 200
_KEEP_HEAD, _KEEP_TAIL = 60, 20


def _clipped(word: re.Match) -> str:
    text = word[0]
    return f"{text[:_KEEP_HEAD]}...({len(text):,} characters)...{text[-_KEEP_TAIL:]}"


def error_line(message: object) -> str:
    """`error: MESSAGE`, folded to one line, every word over LONGEST_WORD characters cut
    to its start and end with its length between."""
    text = " ".join(str(message).split())
    text = re.sub(rf"\S{{{LONGEST_WORD + 1},}}", _clipped, text)
    return text if text.startswith("error: ") else f"error: {text}"


def print_error(message: object) -> None:
    """The error line on stderr, flushed (a process may exit at once after it)."""
    print(error_line(message), file=sys.stderr, flush=True)


def fail(message: object, code: int = 2) -> NoReturn:
    """The error line and the exit code (2: bad input; the table in docs/faults.md)."""
    print_error(message)
    sys.exit(code)
