"""The record of the config that defines a workdir's run (run_config.json): written on
the first start, compared on every resume (a field of the math may not change), and the
run's identity stamped on its checkpoints. Each failure is one line (ConfigError, or
WorkdirError for an unreadable record)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_collections

from largebatch_jax import fields, plan
from largebatch_jax.errors import ConfigError, WorkdirError
from largebatch_jax.workdir import atomic_write_text

RECORD = "run_config.json"

# What a resume may change (fields.MAY_CHANGE: every role but the math), and the value a
# field newer than a record counts as (fields.BEFORE_FIELD). A math field the record
# lacks and the table gives no such value stops the resume rather than being guessed.
MAY_CHANGE = fields.MAY_CHANGE
BEFORE_FIELD: dict[str, Any] = fields.BEFORE_FIELD


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value))  # tuples -> lists, as the record stores them


def read_record(workdir: Path) -> dict | None:
    path = workdir / RECORD
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else e
        raise WorkdirError(
            f"{path} is not readable ({why}): restore it from the run's result.json 'config', "
            "or use a new workdir."
        ) from None
    if not isinstance(record, dict):
        raise WorkdirError(
            f"{path} holds {type(record).__name__} {str(record)[:40]!r}, not a config: restore "
            "it from the run's result.json 'config', or use a new workdir."
        )
    return record


def write_record(workdir: Path, config: Any) -> None:
    atomic_write_text(workdir / RECORD, json.dumps(_plain(config.to_dict()), indent=2) + "\n")


def check_resume(recorded: dict, config: Any, step: int, steps_per_epoch: int) -> None:
    """The config of a run resumed at `step` against the recorded one: every field that
    changes the math must be equal; ConfigError (one line: the fields, both values, the
    fix) otherwise. A field newer than the record counts as its BEFORE_FIELD value; a
    field the code no longer has is ignored (it cannot be set)."""
    current = _plain(config.to_dict())
    skip = set(MAY_CHANGE) | {"num_epochs"}
    unknown = sorted(set(current) - set(recorded) - skip - set(BEFORE_FIELD))
    if unknown:
        raise ConfigError(
            f"this workdir's {RECORD} has no field {', '.join(unknown)}, so what its run was "
            "trained with is unknown: add the field with its value to the record, or use "
            "a new workdir."
        )
    recorded = {**{f: _plain(v) for f, v in BEFORE_FIELD.items()}, **recorded}
    shared = sorted(set(recorded) & set(current) - skip)
    for f in shared:
        if _kind(recorded[f]) != _kind(current[f]):
            raise ConfigError(
                f"this workdir's {RECORD} has {f}={recorded[f]!r}, not a value of the field's "
                f"type ({type(current[f]).__name__}): the record was edited or damaged: "
                "restore it (result.json holds a copy of the config) or use a new workdir."
            )
    differ = [f for f in shared if recorded[f] != current[f]]
    if differ:
        what = ", ".join(f"{f}={recorded[f]!r} (this config: {current[f]!r})" for f in differ)
        fix = " ".join(f"--config.{f}={_flag(recorded[f])}" for f in differ)
        raise ConfigError(
            f"the run in this workdir was trained with {what}; resuming would change its "
            f"math: rerun with {fix}, or use a new workdir."
        )
    before, now = recorded.get("num_epochs"), current["num_epochs"]
    if before is None or before == now:
        return
    new = plan.learning_rate(config, steps_per_epoch)
    total = new.total_steps
    if step > total:
        raise ConfigError(
            f"config.num_epochs={now} ({total} steps) ends before this workdir's checkpoint at "
            f"step {step} (trained with num_epochs={before}): rerun with "
            f"--config.num_epochs={before}, or use a new workdir."
        )
    old = plan.learning_rate(
        ml_collections.ConfigDict({**dict(current), **recorded}), steps_per_epoch
    ).schedule()
    steps = jnp.arange(step)
    if step and not bool(jnp.all(old(steps) == new.schedule()(steps))):
        raise ConfigError(
            f"config.num_epochs={now} (trained with {before}) changes the learning rate of "
            f"the {step} steps already trained (lr_decay={config.lr_decay!r}): rerun with "
            f"--config.num_epochs={before}, or use a new workdir."
        )


def run_identity(config: Any) -> str:
    """The identity of the run a config defines, stamped on its checkpoints: the sha256 of
    every field that changes the math (not MAY_CHANGE, not num_epochs), where a field at
    its BEFORE_FIELD value counts as absent (so adding a field keeps old identities).
    Numbers count as floats, as check_resume compares them (1 == 1.0)."""
    skip = set(MAY_CHANGE) | {"num_epochs"}
    fields = {
        f: _as_float(v)
        for f, v in _plain(config.to_dict()).items()
        if f not in skip and not (f in BEFORE_FIELD and v == _plain(BEFORE_FIELD[f]))
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _as_float(value: Any) -> Any:
    if isinstance(value, list):
        return [_as_float(v) for v in value]
    return float(value) if _kind(value) == "number" else value


def _kind(value: Any) -> str:
    """A value's JSON kind: numbers are one kind (a float field may hold 1 or 1.0)."""
    if isinstance(value, bool):
        return "bool"
    return "number" if isinstance(value, int | float) else type(value).__name__


def _flag(value: Any) -> str:
    if isinstance(value, list):
        return "(" + ",".join(map(str, value)) + ("," if len(value) == 1 else "") + ")"
    return str(value)
