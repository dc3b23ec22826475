"""Config validation, before anything is compiled: one line naming the field, the value
and the fix, raised as ConfigError (main turns it into exit code 2)."""

from __future__ import annotations

import difflib
import math
from typing import Any

from largebatch_jax import fields, grouped, parallel, schedules


class ConfigError(ValueError):
    """A bad config value; the message is one line."""


# field: (types, check, what the check means), from the one table of fields.
RULES: dict[str, tuple[tuple[type, ...], Any, str]] = {
    name: (f.types, f.check, f.meaning) for name, f in fields.FIELDS.items() if f.types
}


def validate_config(config: Any, num_devices: int, platform: str | None = None) -> int:
    """Check every field's type and range and the minibatch geometry, and what depends on
    the `platform` the steps compile for where it is given; returns the per-device
    micro-batch. Raises ConfigError with one line."""
    validate_fields(config)
    try:
        micro = parallel.micro_batch_size(
            config.batch_size, num_devices, config.accum_steps, config.bn_group_size
        )
    except ValueError as e:
        raise ConfigError(f"config.{e}") from None
    if config.eval_batch_size % num_devices:
        raise ConfigError(
            f"config.eval_batch_size={config.eval_batch_size} is not divisible by the "
            f"{num_devices} devices."
        )
    if config.reduction == "exact":
        _check_exact(config, num_devices)
        if platform and parallel.is_gpu(platform) and config.parallelism == "pmap":
            raise ConfigError(
                "config.reduction='exact' on GPU compiles with XLA's determinism option, "
                "which parallelism='pmap' cannot pass: set parallelism='shard_map'."
            )
    return micro


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
    """What does not depend on the devices: every field known, its type and range, and
    the schedule's boundaries (a sweep checks its runs with this before training any)."""
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
    try:
        schedules.check_decay_epochs(config.decay_epochs, config.num_epochs)
    except ValueError as e:
        raise ConfigError(f"config.{e}") from None
    warms = schedules.warmup_applies(config.batch_size, config.base_batch_size)
    warms = warms and config.warmup != "none"
    if warms and config.decay_epochs and config.warmup_epochs > min(config.decay_epochs):
        raise ConfigError(
            f"config.warmup_epochs={config.warmup_epochs} runs past the first decay at epoch "
            f"{min(config.decay_epochs)}: shorten the warmup."
        )


def _check_exact(config: Any, num_devices: int) -> None:
    """Where reduction='exact' can keep its promise (grouped.py, exact.py): the tree
    of the k groups splits into the devices' blocks only for a power-of-two number of
    groups per device; per-worker BN."""
    kn, n = config.batch_size, config.bn_group_size
    groups = kn // num_devices // n
    if not grouped.whole_power_of_two_groups(kn // num_devices, n):
        raise ConfigError(
            f"config.reduction='exact' needs a power-of-two number of BN groups per device, "
            f"but batch_size={kn} / {num_devices} devices / bn_group_size={n} = {groups}: "
            "change batch_size or the number of devices, or set reduction='fast'."
        )
    if config.bn_sync:
        raise ConfigError(
            "config.reduction='exact' sums per-worker BN groups and does not apply with "
            "bn_sync=True: set reduction='fast'."
        )
    per_device = config.eval_batch_size // num_devices
    if per_device % n:
        raise ConfigError(
            f"config.eval_batch_size={config.eval_batch_size} gives {per_device} images per "
            f"device, not a multiple of bn_group_size={n} (exact evaluation runs n images "
            "at a time): change eval_batch_size, or set reduction='fast'."
        )
