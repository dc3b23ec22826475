"""One run of the paper's recipe: `setup.build` (checks, data, the step, the newest
checkpoint), `loop.run_steps` (steps, reports, evaluations, checkpoints, preemption) and
`result.finish` (result.json). `train_and_evaluate` ties them and closes what they open;
a known fault leaves as one line (`errors.one_line_error`).

What advances from step to step is passed explicitly: the TrainState, and the host's
`state.Progress`, saved beside it in every checkpoint.
"""

from __future__ import annotations

import json
import time
from typing import Any

from absl import logging

from largebatch_jax.metrics import TrainClock, create_writer, run_summaries
from largebatch_jax.train.faults import one_line_error
from largebatch_jax.train.loop import run_steps
from largebatch_jax.train.reporting import key_hyperparameters
from largebatch_jax.train.result import RESULT, finish, finished_result, paper_metric
from largebatch_jax.train.setup import build, load_data
from largebatch_jax.train.teardown import Closer

__all__ = [
    "build",
    "load_data",
    "paper_metric",
    "train_and_evaluate",
]


def train_and_evaluate(config: Any, workdir: str) -> dict:
    """Train and evaluate one run of the paper's recipe; resumes from `workdir`.

    Returns the result (also written to workdir/result.json), or {'preempted': step,
    'checkpoints': directory} after a SIGTERM, with that step's checkpoint saved.
    """
    started = time.perf_counter()
    run, state, progress = build(config, workdir)
    closer = Closer(("checkpoints", run.checkpointer.close), ("loader", run.train_loader.close))
    try:
        done = finished_result(run, progress)
        if done is not None:
            logging.info("the run in %s is finished: its %s stays as it is", run.workdir, RESULT)
            closer.close()
            return done
        clock = TrainClock(
            run.plan.total_steps, progress.step, progress.train_seconds, started_at=started
        )
        writer = create_writer(run.workdir, run.is_main)
        closer.parts.append(("metric writers", writer.close))
        if run.is_main:
            config_json = json.dumps(config.to_dict(), indent=2, default=str)
            for summary in run_summaries(config_json, key_hyperparameters(config, run.plan)):
                writer.write_summary(progress.step, summary)
        state, preempted = run_steps(run, state, progress, writer, clock)
        closer.close()
        if preempted is not None:
            return {"preempted": preempted, "checkpoints": str(run.checkpointer.directory)}
        return finish(run, state, progress, clock)
    except BaseException as e:
        closer.close(quiet=True)
        kept = run.checkpointer.steps()
        known = one_line_error(e, kept, run.checkpointer.directory, run.workdir)
        if known is None:
            raise
        raise known from None
    finally:
        if run.lock is not None:
            run.lock.release()
