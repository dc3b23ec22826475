"""Other libraries' errors about the command line, as main.py's one line: what absl's flag
parsing and ml_collections' config loading raise, reworded to name the flag or field,
the value and the fix. Imports no JAX."""

from __future__ import annotations

import re
from pathlib import Path

from largebatch_jax.fields import FIELDS
from largebatch_jax.validate import unknown_field


def config_error(error: BaseException, argv: list[str]) -> str:
    """One line for what loading --config or applying --config.FIELD raised."""
    text = str(error).strip().strip("'\"").replace("\\n", "\n")
    # ml_collections words it either way, by version and code path.
    typo = re.search(r"'(\w+)'.*?Did you mean \"(\w+)\"", text, re.S)
    field = typo[1] if typo else None
    if typo is None:
        typo = re.search(r"Did you mean \"(\w+)\" instead of \"(\w+)\"", text)
        field = typo[2] if typo else None
    if isinstance(error, AttributeError | KeyError) and field:
        return unknown_field(field, "--config.")
    if isinstance(error, AttributeError | KeyError):  # no near field for ml_collections
        unknown = [f for a in argv if (f := _overridden(a)) and f not in FIELDS]
        if unknown:
            return unknown_field(unknown[0], "--config.")
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if spec is not None and "has no attribute 'get_config" in text:
        return (
            f"--config={spec}: the file defines no get_config(): a config file returns its "
            "ConfigDict from get_config(), as configs/smoke.py does."
        )
    if spec is not None:
        path = Path(spec.split(":", 1)[0])
        if not path.is_file():
            return f"--config={spec}: no such config file {str(path)!r}."
        try:
            source = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            return (
                f"--config={spec}: {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at "
                f"{e.start}; UTF-16?): save it as UTF-8."
            )
        if "\x00" in source:
            return f"--config={spec}: {path} holds NUL bytes: save it as UTF-8 text."
        try:
            compile(source, str(path), "exec")
        except SyntaxError as e:
            return f"--config={spec}: syntax error in {path} line {e.lineno}: {e.msg}."
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"


def _overridden(arg: str) -> str | None:
    """The field an argument `--config.FIELD[.SUB]=VALUE` sets, or None."""
    match = re.match(r"--config\.(\w+)", arg)
    return match[1] if match else None


def flag_error(text: str) -> str:
    """absl's flag error in one line; for a config file that failed, with its reason (the
    last line of the traceback absl puts under it)."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    if len(lines) < 2 or "parsing config file" not in lines[0]:
        return lines[0] if lines else text
    reason = lines[-1]
    if "get_config() takes 0 positional arguments" in reason:
        reason = "this config file takes no FIELD=VALUE after ':'; use --config.FIELD=VALUE"
    return f"{lines[0].removesuffix(':').replace('Error whilst parsing', 'cannot parse')}: {reason}"
