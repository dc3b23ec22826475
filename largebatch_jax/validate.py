"""The config's fields, each against the table (fields.py): known, of its type, in its
range; one line naming the field, the value and the fix, raised as ConfigError (exit code
2). What depends on several fields, the devices or the data is checked where the run's
plan is resolved (plan.py)."""

from __future__ import annotations

import difflib
import math
from typing import Any

from largebatch_jax import fields
from largebatch_jax.errors import ConfigError

# field: (types, check, what the check means), from the one table of fields.
RULES: dict[str, tuple[tuple[type, ...], Any, str]] = {
    name: (f.types, f.check, f.meaning) for name, f in fields.FIELDS.items() if f.types
}


def unknown_field(field: str, prefix: str = "config.") -> str:
    """The one line for a field the table does not have, with the nearest that it has
    (`prefix` '--config.' for a flag)."""
    near = difflib.get_close_matches(field, list(fields.FIELDS), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return (
        f"{prefix}{field}: the config has no field {field!r}{hint}; the fields are in "
        "configs/base.py."
    )


def check_known_fields(config: Any) -> None:
    """Every field of `config` is in the table: a field a config file sets by a typo
    (`c.batch_szie = 128`) would otherwise be carried along unused."""
    for field in config:
        if field not in fields.FIELDS:
            raise ConfigError(unknown_field(field))


def validate_fields(config: Any) -> None:
    """Every field known, of its type and in its range."""
    check_known_fields(config)
    for field, (types, check, meaning) in RULES.items():
        if field not in config:
            raise ConfigError(f"config.{field} is missing: start the config from configs/base.py.")
        value = config[field]
        # bool is an int in Python: keep True out of integer fields and 1 out of bools.
        if isinstance(value, bool) != (bool in types) or not isinstance(value, types):
            names = " or ".join(t.__name__ for t in types)
            raise ConfigError(f"config.{field}={value!r} must be a {names}.")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"config.{field}={value!r} must be a finite number.")
        if check is not None and not check(value):
            raise ConfigError(f"config.{field}={value!r} must be {meaning}.")
    decays = config.get("decay_epochs", ())
    if not isinstance(decays, tuple | list) or not all(
        isinstance(e, float | int) and not isinstance(e, bool) and 0 <= e < math.inf for e in decays
    ):
        raise ConfigError(
            f"config.decay_epochs={decays!r} must be a tuple of epochs, e.g. (30, 60, 80)."
        )
