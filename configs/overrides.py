"""One grammar for config overrides written as text: `FIELD=VALUE` in
`configs/imagenet.py:batch_size=8192,warmup=none` and in experiments.sweep's
`--grid`, `--set` and `--extra`.

A value is parsed with the type of the field's default: booleans as true/false (or 1/0,
any case, as absl's boolean flags take them), integers, floats, strings, and tuples as
`a;b;c` or `(a;b;c)` with the element type of the default's first element (`;` because
`,` separates assignments and values). `flag_spelling` writes a value the way
`--config.FIELD=...` (ml_collections' flag parser) reads it back.
"""

from __future__ import annotations

from typing import Any

_TRUE, _FALSE = ("true", "1"), ("false", "0")


def parse_value(field: str, text: str, default: Any) -> Any:
    """`text` as a value of the type of `field`'s `default`; a ValueError (one line,
    naming the field, the text and the expected type) otherwise."""
    try:
        if isinstance(default, bool):
            if text.strip().lower() not in _TRUE + _FALSE:
                raise ValueError
            return text.strip().lower() in _TRUE
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        if isinstance(default, tuple):
            kind = type(default[0]) if default else float
            items = [x.strip() for x in text.strip().strip("()").split(";") if x.strip()]
            return tuple(parse_value(field, x, kind()) for x in items)
        if isinstance(default, str):
            return text
    except ValueError:
        pass
    kind = type(default).__name__
    article = "an" if kind[0] in "aeiou" else "a"
    raise ValueError(
        f"{field}={text!r} is not {article} {kind} like the default {default!r}"
        + (" (tuples are written a;b;c)" if isinstance(default, tuple) else "")
        + "."
    )


def apply_overrides(config: Any, text: str | None, where: str = "config") -> Any:
    """`config` with the comma-separated `FIELD=VALUE` assignments of `text` applied."""
    for item in filter(None, (text or "").split(",")):
        field, equals, value = item.partition("=")
        if not equals:
            raise ValueError(f"{where}: {item!r} in {text!r} must be FIELD=VALUE.")
        if field not in config:
            raise ValueError(f"{where}: unknown field {field!r} in {text!r} (see configs/base.py).")
        config[field] = parse_value(field, value, config[field])
    return config


def flag_spelling(value: Any) -> str:
    """The `--config.FIELD=...` spelling of a value (tuples as Python literals)."""
    if isinstance(value, tuple):
        return "(" + ",".join(str(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return str(value)
