"""One override grammar for `configs/imagenet.py:FIELD=VALUE,...` and the sweep
(`python -m experiments.sweep`)."""

import importlib.util
import subprocess
import sys

import pytest

from configs import base, imagenet
from configs.overrides import apply_overrides, flag_spelling, parse_value
from largebatch_jax import fields
from tests.runs import ROOT


def _sweep():
    return importlib.import_module("experiments.sweep")


GOOD = [
    ("zero_init_residual", "False", False),
    ("zero_init_residual", "true", True),
    ("zero_init_residual", "1", True),
    ("zero_init_residual", "0", False),
    ("batch_size", "8192", 8192),
    ("base_lr", "0.2", 0.2),
    ("base_lr", "1", 1.0),
    ("warmup", "none", "none"),
    ("decay_epochs", "30;60", (30.0, 60.0)),
    ("decay_epochs", "(1;2.5)", (1.0, 2.5)),
    ("decay_epochs", "()", ()),
]
BAD = [
    ("zero_init_residual", "yes"),
    ("batch_size", "1.5"),
    ("batch_size", "True"),
    ("base_lr", "fast"),
    ("decay_epochs", "30;x"),
]


@pytest.mark.parametrize("field,text,value", GOOD)
def test_both_parsers_read_a_value_the_same_way(field, text, value):
    default = base.get_config()[field]
    parsed = parse_value(field, text, default)
    assert parsed == value and type(parsed) is type(value)
    assert _sweep().parse_value(field, text, default) == parsed
    assert imagenet.get_config(f"{field}={text}")[field] == parsed


@pytest.mark.parametrize("field,text", BAD)
def test_both_parsers_reject_a_value_naming_the_field(field, text):
    default = base.get_config()[field]
    sweep = _sweep()
    for parse in (parse_value, sweep.parse_value):
        with pytest.raises(ValueError) as error:
            parse(field, text, default)
        message = str(error.value)
        assert message.startswith(f"{field}={text!r}") and "\n" not in message
    with pytest.raises(ValueError, match=field):
        imagenet.get_config(f"{field}={text}")


def test_int_tuples_keep_their_type_and_assignments_apply_in_order():
    assert parse_value("sizes", "1;2", (8, 16)) == (1, 2)
    c = apply_overrides(base.get_config(), "batch_size=512,warmup=constant,batch_size=1024")
    assert (c.batch_size, c.warmup) == (1024, "constant")
    with pytest.raises(ValueError, match="unknown field 'batch_szie'"):
        apply_overrides(base.get_config(), "batch_szie=64")
    with pytest.raises(ValueError, match="must be FIELD=VALUE"):
        apply_overrides(base.get_config(), "batch_size")


@pytest.mark.parametrize(
    "field,value",
    [
        ("decay_epochs", (30.0, 60.0)),
        ("decay_epochs", (1.0,)),
        ("nesterov", False),
        ("base_lr", 0.1),
        ("warmup", "none"),
        ("batch_size", 8192),
    ],
)
def test_flag_spelling_is_what_ml_collections_reads_back(field, value):
    """The sweep passes values to main.py as --config.FIELD=<flag_spelling>."""
    from absl import flags
    from ml_collections import config_flags

    argv = [
        sys.argv[0],
        f"--config={ROOT / 'configs/base.py'}",
        f"--config.{field}={flag_spelling(value)}",
    ]
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)  # as main.py
    values(argv)
    assert values.config[field] == value


def test_the_field_table_is_the_one_list_the_others_derive_from():
    """configs/base.py, the validation, the resume comparison and the cross-process check
    all read largebatch_jax/fields.py: one entry per field, each with a role, and every
    value assumed for records older than a field is a value the field takes."""
    from largebatch_jax import fields, validate
    from largebatch_jax import record as run_record

    table = fields.FIELDS
    assert set(base.get_config()) == set(table)
    assert {k: v for k, v in base.get_config().items()} == {k: f.default for k, f in table.items()}
    # Every field's type and check, but decay_epochs, which validate checks itself.
    assert set(validate.RULES) == set(table) - {"decay_epochs"}
    roles = {f.role for f in table.values()}
    assert roles == {fields.MATH, fields.LAYOUT, fields.REPORTING, fields.HOST}
    assert set(run_record.MAY_CHANGE) == {k for k, f in table.items() if f.role != fields.MATH}
    assert set(fields.HOST_LOCAL) == {"data_dir", "workers", "threads", "compilation_cache"}
    assert run_record.BEFORE_FIELD == {"reduction": "fast", "lr_multiplier": 1.0}
    for name, before in run_record.BEFORE_FIELD.items():
        assert table[name].role == fields.MATH and validate.RULES[name][1](before)
    # The check runs: a field's bad value is refused naming it.
    config = base.get_config()
    config.reduction = "slow"
    with pytest.raises(validate.ConfigError, match=r"config.reduction='slow' must be one of"):
        validate.validate_fields(config)


def test_the_tables_choices_are_the_codes_own():
    """fields.py lists the choices of the fields that name code itself (the table loads
    without JAX); each list is the one the code dispatches on."""
    from largebatch_jax import optim, parallel, schedules, step
    from largebatch_jax.models import resnet

    assert fields.MODEL_NAMES == resnet.MODEL_NAMES
    assert tuple(resnet.DTYPES) == fields.DTYPES
    assert tuple(resnet.CONV_IMPLS) == fields.CONV_IMPLS
    assert (fields.OPTIMIZERS, fields.UPDATE_FORMS) == (optim.OPTIMIZERS, optim.UPDATE_FORMS)
    assert fields.REDUCTIONS == step.REDUCTIONS
    assert (fields.ACCUM_LOOPS, fields.PARALLELISMS) == (
        parallel.ACCUM_LOOPS,
        parallel.PARALLELISMS,
    )
    assert (fields.LR_SCALING_RULES, fields.WARMUP_KINDS, fields.DECAY_KINDS) == (
        schedules.LR_SCALING_RULES,
        schedules.WARMUP_KINDS,
        schedules.DECAY_KINDS,
    )


def test_a_config_file_loads_without_jax():
    """configs/base.py and the field table import neither JAX, Flax nor optax."""
    code = (
        "import sys; from configs import imagenet_8k; imagenet_8k.get_config(); "
        "print(sorted(m for m in ('jax', 'flax', 'optax') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]
