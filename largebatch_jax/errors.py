"""The `error:` line every entry point prints (docs/faults.md): one line on the screen,
whatever the message quotes. A value typed or pasted by mistake (100 KB of digits, a
file's contents) is shown by its start, its end and its length; newlines are folded.
Importing this module imports nothing of the project's and changes nothing."""

from __future__ import annotations

import re
import sys
from typing import NoReturn

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
