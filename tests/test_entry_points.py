"""Every command a user types prints its usage under the name typed, each flag with a line
of help (absl keeps its own exit code for --help)."""

import sys

import pytest

from largebatch_jax import launch, plot
from tests.runs import call

COMMANDS = [
    (["main.py"], "python main.py --config="),
    (["-m", "largebatch_jax.launch"], "usage: python -m largebatch_jax.launch --processes N"),
    (["-m", "largebatch_jax.plot"], "usage: python -m largebatch_jax.plot"),
    (["-m", "largebatch_jax.aot"], "python -m largebatch_jax.aot"),
    (["-m", "largebatch_jax.data.prepare"], "python -m largebatch_jax.data.prepare fashion_mnist"),
    (["-m", "experiments.sweep"], "usage: python -m experiments.sweep"),
]


@pytest.mark.parametrize("command,usage", COMMANDS, ids=[c[-1] for c, _ in COMMANDS])
def test_help_prints_the_usage_under_the_name_typed(command, usage):
    out = call([sys.executable, *command, "--help"], timeout=120)
    assert out.returncode in (0, 1), out.stderr[-2000:]  # absl's --help exits 1 in some versions
    assert usage in out.stdout + out.stderr, out.stdout[:2000]
    lines = (out.stdout + out.stderr).splitlines()
    assert not [x for x in lines if x.startswith("error") or "Traceback" in x], lines[:20]


@pytest.mark.parametrize("parser", [launch.parser, plot.parser], ids=["launch", "plot"])
def test_every_flag_of_an_argparse_command_has_help(parser):
    actions = [a for a in parser()._actions if a.dest != "help"]
    assert actions and all(a.help for a in actions), [a.dest for a in actions if not a.help]
