"""The per-device train and eval steps (one paper worker's view of an SGD update).

A device holds `accum_steps * micro_batch` images of the global minibatch kn. For each
micro-step it runs the model with BatchNorm over groups of n, takes the mean
cross-entropy and its gradient; the gradients are averaged over micro-steps and then
`lax.pmean`-ed over devices, which is exactly the gradient of the loss averaged over all
kn images (paper Remark 3). See DESIGN.md, "The step, per device".
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import linen as nn
from jax.experimental import multihost_utils

from largebatch_jax import optim, parallel, schedules
from largebatch_jax.checkpoint import Checkpointer
from largebatch_jax.data import loader, sources
from largebatch_jax.metrics import MetricWriter, Progress, format_eta, read_metrics
from largebatch_jax.models import create_model
from largebatch_jax.parallel import AXIS
from largebatch_jax.validate import ConfigError, validate_config


@flax.struct.dataclass
class TrainState:
    """Everything an SGD update changes; a plain pytree (checkpointable as is)."""

    step: jax.Array
    params: Any
    batch_stats: Any
    opt_state: Any


def create_train_state(
    rng: jax.Array, model: nn.Module, tx: optax.GradientTransformation, image_shape: tuple
) -> TrainState:
    """Initialise parameters (the paper's init lives in the model), BN statistics
    (mean 0, var 1) and the optimizer state, on the host's default device."""

    @jax.jit
    def init(rng):
        variables = model.init(rng, jnp.zeros((1, *image_shape), jnp.float32), train=False)
        params = variables["params"]
        return TrainState(
            step=jnp.zeros([], jnp.int32),
            params=params,
            batch_stats=variables["batch_stats"],
            opt_state=tx.init(params),
        )

    return init(rng)


def mean_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Paper Remark 3: the loss is normalised by the number of images it sums over.

    Per micro-batch mean here; the mean over micro-steps and devices (all of equal size)
    then normalises by the whole minibatch kn.
    """
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def topk_errors(logits: jax.Array, labels: jax.Array, k: int) -> jax.Array:
    """1.0 where the label is not among the k highest logits, per example."""
    k = min(k, logits.shape[-1])
    _, top = jax.lax.top_k(logits, k)
    return 1.0 - jnp.any(top == labels[:, None], axis=-1).astype(jnp.float32)


def _varying(tree: Any) -> Any:
    """Mark a fresh value as differing per device (the scan carry of per-device sums)."""
    return jax.tree.map(lambda x: jax.lax.pcast(x, AXIS, to="varying"), tree)


def make_train_step(
    model: nn.Module,
    tx: optax.GradientTransformation,
    learning_rate_fn: optax.Schedule,
    accum_steps: int = 1,
    accum_loop: str = "scan",
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """The per-device SGD update; map it over devices with `DataParallel.map`.

    batch: {'image': [accum_steps * micro, H, W, C], 'label': [accum_steps * micro]}.
    Returns the new state (identical on every device) and metrics averaged over kn.
    `accum_loop`: the micro-steps as one `lax.scan` ('scan': one copy of the model in the
    program, whatever accum_steps is) or as a Python loop ('unroll': accum_steps copies).
    Same sums in the same order; 'auto' picks the faster for this backend
    (`parallel.resolve_accum_loop`).
    """
    accum_loop = parallel.resolve_accum_loop(accum_loop, jax.default_backend())
    if accum_loop not in parallel.ACCUM_LOOPS:
        raise ValueError(f"accum_loop={accum_loop!r} is not one of {parallel.ACCUM_LOOPS}.")

    def loss_fn(params, batch_stats, images, labels):
        logits, updated = model.apply(
            {"params": params, "batch_stats": batch_stats},
            images,
            train=True,
            mutable=["batch_stats"],
        )
        return mean_cross_entropy(logits, labels), (logits, updated["batch_stats"])

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        images, labels = batch["image"], batch["label"]
        if images.shape[0] % accum_steps:
            raise ValueError(
                f"accum_steps={accum_steps} does not divide the per-device batch {images.shape[0]}."
            )
        micro = images.shape[0] // accum_steps
        images = images.reshape(accum_steps, micro, *images.shape[1:])
        labels = labels.reshape(accum_steps, micro)

        # Differentiate a per-device copy of the parameters: the gradient is then this
        # device's own, and the explicit pmean below is the only reduction. (Taken w.r.t.
        # the replicated value, shard_map would psum it implicitly.)
        local_params = _varying(state.params)

        def micro_step(x, y):
            # Every micro-step starts from the same BN statistics: each group is one
            # worker's update of the old running averages, later averaged (DESIGN.md 4).
            (loss, (logits, stats)), grads = grad_fn(local_params, state.batch_stats, x, y)
            return grads, stats, loss, topk_errors(logits, y, 1).mean()

        if accum_loop == "unroll":
            sums = micro_step(images[0], labels[0])
            for i in range(1, accum_steps):
                sums = jax.tree.map(jnp.add, sums, micro_step(images[i], labels[i]))
        else:
            zeros = jax.tree.map(
                jnp.zeros_like, (state.params, state.batch_stats, jnp.float32(0), jnp.float32(0))
            )
            sums, _ = jax.lax.scan(
                lambda sums, xy: (jax.tree.map(jnp.add, sums, micro_step(*xy)), None),
                _varying(zeros),
                (images, labels),
            )
        grads, batch_stats, loss, error = jax.lax.pmean(
            jax.tree.map(lambda s: s / accum_steps, sums), AXIS
        )

        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # A non-finite loss or gradient leaves the state as it was (the step still counts),
        # so the state in memory is always a good one; the loop stops or skips on the flag.
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # Integer leaves are counters (the schedule's step inside optax): they advance, so
        # the rate applied stays the one of state.step.
        keep_new = functools.partial(
            jax.tree.map,
            lambda new, old: (
                jnp.where(finite, new, old) if jnp.issubdtype(new.dtype, jnp.inexact) else new
            ),
        )
        new_state = state.replace(
            step=state.step + 1,
            params=keep_new(params, state.params),
            batch_stats=keep_new(batch_stats, state.batch_stats),
            opt_state=keep_new(opt_state, state.opt_state),
        )
        metrics = {
            "nonfinite": 1.0 - finite.astype(jnp.float32),
            "train_loss": loss,
            "train_error": error,
            "learning_rate": jnp.asarray(learning_rate_fn(state.step), jnp.float32),
            "grad_norm": grad_norm,
            "param_norm": optax.tree.norm(new_state.params),
        }
        return new_state, metrics

    return train_step


def make_eval_step(model: nn.Module) -> Callable[[TrainState, dict], dict]:
    """Per-device evaluation with the running BN statistics.

    batch: {'image', 'label', 'mask'}; padded examples have mask 0. Returns sums over all
    devices (`count`, `loss_sum`, `top1_errors`, `top5_errors`) so that the host can add
    batches and divide once: every real image counts exactly once.
    """

    def eval_step(state: TrainState, batch: dict) -> dict:
        logits = model.apply(
            {"params": state.params, "batch_stats": state.batch_stats},
            batch["image"],
            train=False,
        )
        labels, mask = batch["label"], batch["mask"].astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        sums = {
            "count": jnp.sum(mask),
            "loss_sum": jnp.sum(loss * mask),
            "top1_errors": jnp.sum(topk_errors(logits, labels, 1) * mask),
            "top5_errors": jnp.sum(topk_errors(logits, labels, 5) * mask),
        }
        return jax.lax.psum(sums, AXIS)

    return eval_step


def model_from_config(config: Any) -> nn.Module:
    """The model named by the config, with per-worker BN of `bn_group_size` (rule 9), or
    BN synchronised over all devices when `bn_sync` (the Flax-example ablation)."""
    return create_model(
        config.model,
        config.num_classes,
        config.bn_group_size,
        config.zero_init_residual,
        config.dtype,
        width=config.width,
        bn_momentum=config.bn_momentum,
        bn_epsilon=config.bn_epsilon,
        bn_axis_name=AXIS if config.bn_sync else None,
        conv_impl=config.conv_impl,
    )


# ----------------------------------------------------------------------------- the loop


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the message names the step."""


class _Preemption:
    """A scheduler's preemption notice (SIGTERM), read by the loop between steps.

    One process: our handler sets a flag. Several: JAX's preemption sync service catches
    SIGTERM on any process and makes all of them agree on the step to stop at, so they
    save the same checkpoint together (a process stopping alone would hang the others).
    """

    def __init__(self):
        self.requested = False
        self._previous = None
        self._multi = jax.process_count() > 1

    def __enter__(self):
        if not self._multi and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handler)
        return self

    def _handler(self, signum, frame):
        del signum, frame
        self.requested = True

    def reached(self, step: int) -> bool:
        """Whether to save and stop after `step` (called once per step, on every process)."""
        if self._multi:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


# Fields that may differ between hosts (paths, host CPU threads): not part of the run.
HOST_LOCAL_FIELDS = ("data_dir", "workers")


def _check_processes_agree(config: Any) -> None:
    values = {f"config.{k}": v for k, v in config.to_dict().items() if k not in HOST_LOCAL_FIELDS}
    values["local devices"] = jax.local_device_count()
    values["platform"] = jax.devices()[0].platform
    values["jax version"] = jax.__version__
    try:
        parallel.check_processes_agree(values)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_workdir(workdir: Path) -> None:
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / f".write_test_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"--workdir={workdir} is not writable ({e.strerror}): choose another directory."
        ) from None


def _load_sources(config: Any, data_dir: str) -> tuple[Any, Any, Any]:
    try:
        spec = sources.dataset_spec(config.dataset, data_dir)
    except ValueError as e:
        raise ConfigError(f"config.{e}") from None
    if config.num_classes != spec.num_classes:
        raise ConfigError(
            f"config.num_classes={config.num_classes} but {config.dataset} has "
            f"{spec.num_classes} classes: set num_classes={spec.num_classes}."
        )
    if config.channels != len(spec.mean):
        raise ConfigError(
            f"config.channels={config.channels} but {config.dataset} images have "
            f"{len(spec.mean)}: set channels={len(spec.mean)}."
        )
    train_src = sources.load_source(config.dataset, spec.train_split, data_dir)
    eval_src = sources.load_source(config.dataset, spec.eval_split, data_dir)
    try:
        if config.train_subset:
            train_src = sources.Subset(train_src, config.train_subset)
        if config.eval_subset:
            eval_src = sources.Subset(eval_src, config.eval_subset)
    except ValueError as e:
        raise ConfigError(f"config.train_subset / eval_subset: {e}") from None
    if not spec.large_images and spec.native_size % config.image_size:
        raise ConfigError(
            f"config.image_size={config.image_size} must divide {config.dataset}'s native size "
            f"{spec.native_size} (images are downscaled by box averaging)."
        )
    if config.batch_size > len(train_src):
        raise ConfigError(
            f"config.batch_size={config.batch_size} is larger than the training set "
            f"({len(train_src)} images)."
        )
    return spec, train_src, eval_src


def params_digest(params: Any) -> str:
    """sha256 of every parameter's bytes: equal digests mean bit-identical parameters."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(params)):
        digest.update(np.ascontiguousarray(leaf).tobytes())
    return digest.hexdigest()


def paper_metric(evals: list[dict], num_epochs: float, last_epochs: float) -> dict:
    """Paper rule 14: a run's error is the median top-1 validation error of the
    evaluations made in its last `last_epochs` epochs (5 in the paper)."""
    used = [e for e in evals if e["epoch"] > num_epochs - last_epochs + 1e-9]
    return {
        "val_error_top1_median_last_epochs": (
            float(np.median([e["val_error_top1"] for e in used])) if used else None
        ),
        "last_epochs": last_epochs,
        "evaluations_used": [
            {"epoch": e["epoch"], "val_error_top1": e["val_error_top1"]} for e in used
        ],
    }


def evaluate(eval_fn, engine, state, eval_src, augment, config) -> dict:
    """Every validation image once (padded, masked); returns error rates and loss."""
    totals: dict[str, float] = {}
    for batch in loader.eval_batches(
        eval_src,
        augment,
        config.eval_batch_size,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        workers=config.workers,
    ):
        sums = jax.device_get(eval_fn(state, engine.shard_batch(batch)))
        for k, v in sums.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    n = totals["count"]
    return {
        "val_error_top1": totals["top1_errors"] / n,
        "val_error_top5": totals["top5_errors"] / n,
        "val_loss": totals["loss_sum"] / n,
        "val_count": n,
    }


def train_and_evaluate(config: Any, workdir: str) -> dict:
    """Train and evaluate one run of the paper's recipe; resumes from `workdir`.

    Returns the result (also written to workdir/result.json), or {'preempted': step}
    after a SIGTERM, with a checkpoint saved.
    """
    _check_processes_agree(config)  # first: every process must then take the same path
    micro = validate_config(config, jax.device_count())
    engine = parallel.DataParallel(parallel.create_mesh(), config.parallelism)
    work = Path(workdir)
    _check_workdir(work)
    data_dir = config.data_dir or sources.default_data_dir()
    spec, train_src, eval_src = _load_sources(config, data_dir)
    is_main = jax.process_index() == 0

    spe = loader.steps_per_epoch(len(train_src), config.batch_size)
    total = schedules.epochs_to_steps(config.num_epochs, spe)
    lr_fn = schedules.create_learning_rate_schedule(config, spe)
    tx = optim.optimizer_from_config(config, lr_fn)
    model = model_from_config(config)
    image_shape = (config.image_size, config.image_size, config.channels)
    augment = loader.default_augmentation(spec, config.image_size, config.color_augment)

    state = engine.replicate(
        create_train_state(jax.random.key(config.seed), model, tx, image_shape)
    )
    ckpt = Checkpointer(work / "checkpoints", config.keep_checkpoints)
    restored = ckpt.restore_latest(state)
    host = {"epoch_sums": {}, "data": None, "skipped": 0}
    if restored is not None:
        state, host = restored
    elif ckpt.steps():
        raise ConfigError(
            f"--workdir={work}: none of the checkpoints {ckpt.steps()} can be restored (corrupt, "
            "or saved with another model or optimizer config): use a new workdir."
        )
    start = int(jax.device_get(state.step))
    train_loader = loader.TrainLoader(
        train_src,
        augment,
        config.batch_size,
        config.seed,
        total,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        workers=config.workers,
    )
    if host["data"] is not None:
        try:
            train_loader.set_state(host["data"])
        except ValueError as e:
            raise ConfigError(f"--workdir={work}: {e}") from None
    if train_loader.step != start:
        raise RuntimeError(f"checkpoint step {start} and loader step {train_loader.step} differ")

    peak = schedules.scaled_learning_rate(
        config.base_lr, config.base_batch_size, config.batch_size, config.lr_scaling
    )
    summary = (
        f"devices={engine.num_devices} (local {engine.num_local_devices}) "
        f"processes={jax.process_count()} | kn={config.batch_size} n={config.bn_group_size} "
        f"k={config.batch_size // config.bn_group_size} accum_steps={config.accum_steps} | "
        f"per device {micro} images/micro-step | local batch {train_loader.local_batch} | "
        f"peak lr {peak:.4g} | {spe} steps/epoch, {total} steps | {config.dataset}: "
        f"{len(train_src)} train / {len(eval_src)} eval images | "
        + (f"resuming at step {start}" if start else "starting")
    )
    logging.info(summary)
    if is_main:
        print(summary, flush=True)
    train_step = engine.map(
        make_train_step(model, tx, lr_fn, config.accum_steps, config.accum_loop),
        donate_state=True,
    )
    eval_step = engine.map(make_eval_step(model))
    writer = MetricWriter(work, is_main)
    progress = Progress(total, start)
    eval_every = max(1, schedules.epochs_to_steps(config.eval_every_epochs, spe))
    pending: list[tuple[int, dict]] = []
    skipped = int(host.get("skipped", 0))
    began = time.time()

    def host_state(step: int) -> dict:
        # A copy: orbax may serialise it after save() returns, while the loop goes on.
        return json.loads(
            json.dumps(
                {
                    "epoch_sums": host["epoch_sums"],
                    "data": loader_state,
                    "skipped": skipped,
                    "step": step,
                }
            )
        )

    def flush(step: int) -> None:
        """Fetch the metrics of the steps since the last flush (the only host sync)."""
        nonlocal skipped
        if not pending:
            return
        fetched = jax.device_get([m for _, m in pending])
        steps = [s for s, _ in pending]
        pending.clear()
        for s, m in zip(steps, fetched, strict=True):
            if m["nonfinite"]:
                if not config.skip_nonfinite:
                    raise NonFiniteLossError(
                        f"non-finite loss at step {s} (epoch {s / spe:.2f}); the state of "
                        f"step {s - 1} is kept and the last checkpoint "
                        f"(step {max(ckpt.steps(), default=0)}) is untouched. Lower the "
                        "learning rate or set --config.skip_nonfinite=True."
                    )
                skipped += 1
                continue
            epoch = (s - 1) // spe
            sums = host["epoch_sums"].setdefault(str(epoch), [0.0, 0.0, 0])
            sums[0] += float(m["train_error"])
            sums[1] += float(m["train_loss"])
            sums[2] += 1
        last = fetched[-1]
        images_per_sec, eta = progress.update(step, config.batch_size)
        scalars = {
            "epoch": step / spe,
            "train_loss": last["train_loss"],
            "train_error": last["train_error"],
            "learning_rate": last["learning_rate"],
            "grad_norm": last["grad_norm"],
            "param_norm": last["param_norm"],
            "images_per_sec": images_per_sec,
            "skipped_steps": skipped,
        }
        writer.write(step, scalars)
        if is_main:
            print(
                f"step {step}/{total} epoch {step / spe:.2f} | loss {scalars['train_loss']:.4f} "
                f"err {scalars['train_error']:.4f} lr {scalars['learning_rate']:.4g} | "
                f"{images_per_sec:.0f} img/s | ETA {format_eta(eta)}",
                flush=True,
            )

    def local_batches():
        for batch in train_loader:
            del batch["index"]  # record ids: for tests and debugging, not for the devices
            yield batch, train_loader.get_state()  # the position after this batch

    # The loader's position after the last batch trained on (what a checkpoint saves).
    loader_state = train_loader.get_state()
    if config.prefetch_batches:
        device_batches = engine.prefetch(local_batches(), config.prefetch_batches)
    else:
        device_batches = ((engine.shard_batch(b), s) for b, s in local_batches())

    with _Preemption() as preemption:
        if start == 0:
            ckpt.save(0, state, host_state(0))  # a good state to fall back to from step 1
        for step in range(start + 1, total + 1):
            if preemption.reached(step - 1):
                flush(step - 1)
                ckpt.save(step - 1, state, host_state(step - 1))
                ckpt.close()
                writer.close()
                if is_main:
                    print(
                        f"preempted: checkpoint saved at step {step - 1} in {ckpt.directory}; "
                        "rerun the same command to resume",
                        flush=True,
                    )
                return {"preempted": step - 1}
            batch, loader_state = next(device_batches)
            state, metrics = train_step(state, batch)
            pending.append((step, metrics))
            epoch_end = step % spe == 0
            if step % config.log_every_steps == 0 or epoch_end or step == total:
                flush(step)
            if epoch_end:
                epoch = step // spe - 1
                err, loss, count = host["epoch_sums"].pop(str(epoch), [0.0, 0.0, 0])
                if count:
                    writer.write(
                        step,
                        {
                            "epoch": step / spe,
                            "epoch_train_error": err / count,
                            "epoch_train_loss": loss / count,
                        },
                    )
            if step % eval_every == 0 or step == total:
                flush(step)
                result = evaluate(eval_step, engine, state, eval_src, augment, config)
                writer.write(step, {"epoch": step / spe, **result})
                if is_main:
                    print(
                        f"eval at epoch {step / spe:.2f}: top-1 error "
                        f"{result['val_error_top1']:.4f} top-5 {result['val_error_top5']:.4f}",
                        flush=True,
                    )
            if step % config.checkpoint_every_steps == 0 or step == total:
                flush(step)
                ckpt.save(step, state, host_state(step))
    ckpt.close()
    writer.close()

    evals = [r for r in read_metrics(work) if "val_error_top1" in r]
    final = evals[-1] if evals else {}
    result = {
        **paper_metric(evals, config.num_epochs, config.result_last_epochs),
        "final_val_error_top1": final.get("val_error_top1"),
        "final_val_error_top5": final.get("val_error_top5"),
        "steps": total,
        "epochs": config.num_epochs,
        "skipped_steps": skipped,
        "train_seconds_this_session": time.time() - began,
        "params_sha256": params_digest(state.params),
        "batch_size": config.batch_size,
        "bn_group_size": config.bn_group_size,
        "peak_learning_rate": peak,
        "config": config.to_dict(),
    }
    if is_main:
        (work / "result.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result
