"""Train and evaluate one run of the paper's recipe.

    python main.py --config=configs/imagenet_8k.py --workdir=/tmp/rn50_8k
    python main.py --config=configs/imagenet.py:batch_size=8192,warmup=constant --workdir=...
    python main.py --config=configs/fashion_mnist.py --workdir=/tmp/fmnist --config.batch_size=1024

Any field can be overridden with --config.FIELD=VALUE. Rerunning the same command resumes
from the newest checkpoint in the workdir; rerunning a finished run prints its result at
once. Under SLURM, MPI or on a Cloud TPU slice every process runs the same command
(docs/many_machines.md). Exit codes (docs/faults.md): 0 done, or preempted by SIGTERM with
a checkpoint saved; 1 a failed run (e.g. NaN loss); 2 bad config / data / workdir (also a
full disk, a workdir in use); 75 another process of the run is gone; 130 SIGINT; 134
JAX's abort of a multi-process run (a process silent past the heartbeat: dead, or the
whole job paused).
"""

import sys

from largebatch_jax import cli, host

cli.stop_outside_the_loop()  # from here on: a signal before the first step is one line
cli.before_jax()
with host.plugin_noise_filtered():  # the installed plugins' loading banners
    import jax
    from absl import app

    from largebatch_jax import errors, exact, train
    from largebatch_jax import workdir as wd
    from largebatch_jax.metrics import filter_library_logs

    FLAGS = cli.define_flags()


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = FLAGS.config.value
    if config.reduction == "exact":
        exact.fix_cpu_threads()  # before the backend starts
    filter_library_logs()
    try:
        workdir = wd.resolve(FLAGS.workdir.value)
        done = train.result.finished_in(workdir, config)
        joined = None if done is not None else cli.join(FLAGS)
    except (ValueError, errors.BadInputError) as e:
        cli.stop(e, 2)
    if done is not None:  # at once: no backend, no waiting for the other processes
        if cli.rank(FLAGS) == 0:
            print(cli.final_line(done, workdir), flush=True)
        return
    cli.start_backend(config, workdir, joined, FLAGS.heartbeat_timeout_seconds.value)
    cli.compilation_cache(config.compilation_cache, workdir)
    try:
        result = train.train_and_evaluate(config, workdir)
    except errors.OneLineError as e:  # the table in docs/faults.md
        cli.stop(e, e.exit_code)
    if jax.process_index() == 0:
        print(cli.final_line(result, workdir), flush=True)


if __name__ == "__main__":
    sys.unraisablehook = cli.unraisable_in_one_line
    app.run(main, flags_parser=lambda argv: cli.parse_flags(argv, FLAGS))
