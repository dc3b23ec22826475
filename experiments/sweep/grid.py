"""A sweep's runs: its arguments parsed with the config's types, the grid expanded, each
run named by what it changes and checked by main.py's validation before any trains."""

from __future__ import annotations

import importlib.util
import itertools
import re
from pathlib import Path
from typing import Any

from configs import overrides as config_overrides
from largebatch_jax import schedules
from largebatch_jax.errors import ConfigError
from largebatch_jax.plan import check_fields, check_layout

ROOT = Path(__file__).resolve().parent.parent.parent
# `devices` is not a config field: the number of (fake CPU) devices a run uses, which
# may go in --grid / --set / --extra like a field (the invariance experiment).
DEFAULT_DEVICES = 8

flag_value = config_overrides.flag_spelling


class SweepError(ValueError):
    """Bad sweep arguments; one line."""


def load_config(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("sweep_config", ROOT / path)
    if spec is None or not (ROOT / path).exists():
        raise SweepError(f"--config={path} does not exist.")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def parse_value(field: str, text: str, default: Any) -> Any:
    """`text` as the type of the config field's default (configs/overrides.py)."""
    try:
        return config_overrides.parse_value(field, text, default)
    except ValueError as e:
        raise SweepError(str(e)) from None


def parse_assignment(text: str, config: Any, many: bool) -> tuple[str, list[Any]]:
    if "=" not in text:
        raise SweepError(f"{text!r} must be FIELD=VALUE{',VALUE...' if many else ''}.")
    field, values = text.split("=", 1)
    if field != "devices" and field not in config:
        raise SweepError(f"{field!r} is not a config field (see configs/base.py).")
    default = DEFAULT_DEVICES if field == "devices" else config[field]
    parts = values.split(",") if many else [values]
    return field, [parse_value(field, v, default) for v in parts]


def parse_extra(text: str, config: Any) -> dict[str, Any]:
    """--extra=F=V,F=V: one more run, beyond the grid."""
    pairs = [parse_assignment(p, config, many=False) for p in text.split(",") if p]
    return {k: v[0] for k, v in pairs}


def run_name(overrides: dict[str, Any], defaults: Any, devices: int | None) -> str:
    """The overrides that change the config, sorted: the run's identity. `devices` is the
    sweep's device count: a run names its own only where it differs (the update does not
    depend on it: README, "The invariance promise"; `check_devices` keeps two counts
    from sharing a workdir)."""
    inert = set()
    if not schedules.warmup_applies(
        overrides.get("batch_size", defaults.batch_size),
        overrides.get("base_batch_size", defaults.base_batch_size),
    ):
        inert = {"warmup", "warmup_epochs"}  # no warmup at or below the base kn
    parts = [
        f"{k}={flag_value(v)}"
        for k, v in sorted(overrides.items())
        if k != "devices" and defaults[k] != v and k not in inert
    ]
    if overrides.get("devices", devices) != devices:
        parts.append(f"devices={overrides['devices']}")
    name = "-".join(parts) or "default"
    return re.sub(r"[^A-Za-z0-9=.,_+-]", "", name.replace("(", "").replace(")", ""))


def expand(grid: list[tuple[str, list[Any]]], fixed: dict[str, Any]) -> list[dict[str, Any]]:
    fields = [f for f, _ in grid]
    return [
        {**fixed, **dict(zip(fields, combo, strict=True))}
        for combo in itertools.product(*[values for _, values in grid])
    ]


def check_run(defaults: Any, overrides: dict[str, Any], devices: int | None, name: str) -> None:
    """A run's config through main.py's own validation, before any run of the sweep trains:
    a bad value stops the sweep with main's one line. Without fake devices (`devices`
    None) the device count is unknown here, so only what does not depend on it."""
    config = defaults.copy_and_resolve_references()
    for field, value in overrides.items():
        if field != "devices":
            config[field] = value
    devices = overrides.get("devices", devices)
    try:
        check_layout(config, devices) if devices else check_fields(config)
    except ConfigError as e:
        raise SweepError(f"run {name}: {e}") from None
