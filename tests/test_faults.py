"""Faults and bad input from outside, as a user meets them: each reproduced on
`python main.py` or the prepare command in a subprocess, asserting the exit code, one
error line naming the problem, the good checkpoints intact, and a rerun after the fault
that ends with the uninterrupted run's params_sha256."""

import functools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import ml_collections
import numpy as np
import pytest

from configs import smoke
from largebatch_jax import launch
from largebatch_jax import lock as lock_module
from largebatch_jax import record as run_record
from largebatch_jax import workdir as wd
from largebatch_jax.data import sources
from largebatch_jax.errors import ConfigError, WorkdirError
from largebatch_jax.lock import WorkdirLock, process_start_time
from largebatch_jax.metrics import read_metrics
from tests.runs import (
    LONGER,
    ROOT,
    call,
    checkpoint_steps,
    command,
    env,
    error_lines,
    final_state,
    foreign_lines,
    prepare_with_a_bad_record,
    result,
    run,
    start,
    wait_for_checkpoint,
    without_timing,
)

pytestmark = pytest.mark.slow
UNSHARE = shutil.which("unshare")


def sha(workdir) -> str:
    return result(workdir)["params_sha256"]


def one_error(out, *words) -> str:
    """The run's single `error:` line, containing every word; every other line of its
    output is the project's own (no traceback, no library's start-up lines)."""
    lines = error_lines(out.stderr)
    assert len(lines) == 1, out.stderr[-3000:]
    assert foreign_lines(out.stdout + out.stderr) == [], out.stderr[-3000:]  # no library noise
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def readable_checkpoints(workdir) -> list[int]:
    """The finished checkpoints, after checking that no save was left half-written."""
    leftovers = [p.name for p in Path(workdir, "checkpoints").iterdir() if "tmp" in p.name]
    assert not leftovers, leftovers
    return checkpoint_steps(workdir)


def test_torn_metrics_line_and_truncated_cache_then_the_rerun_is_exact(
    tmp_path, fashion_mnist_dir, straight
):
    """Defects 1 and 7: SIGKILL in the middle, then the half line a disk that filled
    during an append leaves at the end of metrics.jsonl, and a decoded-image cache cut
    short. The rerun cuts the torn line, decodes the split again, and ends exactly."""
    data_dir = tmp_path / "tfds"
    shutil.copytree(fashion_mnist_dir, data_dir)
    (cache,) = data_dir.rglob("decoded-train.npz")
    proc = start(tmp_path / "wd", data_dir, *LONGER)
    wait_for_checkpoint(proc, tmp_path / "wd", 16)
    proc.kill()
    proc.wait(timeout=60)
    metrics = tmp_path / "wd" / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"step": 17, "epoch": 1.06, "train_lo')  # torn: no end, no newline
    cache.write_bytes(cache.read_bytes()[:1000])
    out = run(tmp_path / "wd", data_dir, *LONGER)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cut a torn last line" in out.stderr and "cannot be read" in out.stderr
    for line in metrics.read_text().splitlines():
        json.loads(line)  # every line is whole again
    assert sha(tmp_path / "wd") == sha(straight)
    assert without_timing(read_metrics(tmp_path / "wd")) == without_timing(read_metrics(straight))


def test_resume_refuses_a_changed_config_and_a_finished_run_changes_nothing(
    tmp_path, fashion_mnist_dir, straight
):
    """A changed config is refused with the fix, on the finished run and on the same run
    cut back to step 32; so is a record whose value has the wrong type."""
    finished = tmp_path / "finished"
    shutil.copytree(straight, finished)
    before = {p: p.read_bytes() for p in (finished / "result.json", finished / "metrics.jsonl")}
    steps = checkpoint_steps(finished)

    out = run(finished, fashion_mnist_dir, *LONGER)
    assert out.returncode == 0 and "done: top-1 error" in out.stdout, out.stderr[-3000:]
    out = run(finished, fashion_mnist_dir, *LONGER, "--config.bn_group_size=2")
    assert out.returncode == 2
    one_error(out, "bn_group_size=4 (this config: 2)", "--config.bn_group_size=4")
    out = run(
        finished,
        fashion_mnist_dir,
        "--config.num_epochs=2.0",
        "--config.decay_epochs=(1.0,1.5)",
    )
    assert out.returncode == 2
    one_error(out, "decay_epochs=[2.0, 3.0] (this config: [1.0, 1.5])")
    out = run(finished, fashion_mnist_dir, *LONGER[:2], "--config.eval_every_epochs=0.5")
    assert out.returncode == 0, out.stderr[-3000:]  # a reporting interval may change
    assert {p: p.read_bytes() for p in before} == before
    assert checkpoint_steps(finished) == steps

    half = tmp_path / "half"  # the same run as if stopped at step 32
    shutil.copytree(straight, half)
    for step in checkpoint_steps(half):
        if step > 32:
            shutil.rmtree(half / "checkpoints" / str(step))
    (half / "result.json").unlink()
    out = run(half, fashion_mnist_dir, *LONGER, "--config.lr_decay=cosine")
    assert out.returncode == 2
    one_error(out, "lr_decay='step' (this config: 'cosine')")
    out = run(half, fashion_mnist_dir, *LONGER, "--config.seed=1", "--config.base_lr=0.2")
    assert out.returncode == 2
    one_error(out, "base_lr=0.1 (this config: 0.2), seed=0 (this config: 1)")
    record = half / run_record.RECORD  # edited by hand: a number written as a string
    original = record.read_text()
    record.write_text(original.replace('"batch_size": 64', '"batch_size": "64"'))
    out = run(half, fashion_mnist_dir, *LONGER)
    assert out.returncode == 2
    one_error(out, "has batch_size='64', not a value of the field's type (int)", "restore it")
    record.write_text(original)
    assert 32 in checkpoint_steps(half) and not (half / "result.json").exists()
    out = run(half, fashion_mnist_dir, *LONGER)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming at step 32" in out.stderr and sha(half) == sha(straight)


def test_resume_rules_for_num_epochs(tmp_path):
    """num_epochs may change only while the rates already applied stay the same."""
    recorded = smoke.get_config()
    rec = json.loads(json.dumps(recorded.to_dict()))
    longer = smoke.get_config()
    longer.num_epochs = 3.0
    run_record.check_resume(rec, longer, 20, 16)  # step decay: extending the run is the same math
    cosine = ml_collections.ConfigDict(dict(rec, lr_decay="cosine"))
    cosine_longer = smoke.get_config()
    cosine_longer.lr_decay, cosine_longer.num_epochs = "cosine", 4.0
    with pytest.raises(ConfigError, match="changes the learning rate of the 13 steps"):
        run_record.check_resume(cosine.to_dict(), cosine_longer, 13, 16)
    shorter = smoke.get_config()
    shorter.num_epochs, shorter.decay_epochs = 1.0, (0.5, 0.75)
    with pytest.raises(ConfigError, match="decay_epochs"):
        run_record.check_resume(rec, shorter, 32, 16)
    shorter.decay_epochs = recorded.decay_epochs = (0.5, 0.75)
    rec = json.loads(json.dumps(recorded.to_dict()))
    with pytest.raises(ConfigError, match=r"ends before this workdir's checkpoint at step 32"):
        run_record.check_resume(rec, shorter, 32, 16)
    changed = smoke.get_config()
    changed.accum_steps, changed.workers, changed.data_dir = 2, 3, "/elsewhere"
    run_record.check_resume(json.loads(json.dumps(smoke.get_config().to_dict())), changed, 16, 16)


def test_the_run_identity_changes_with_the_math_only():
    """A checkpoint's stamp: equal for every config a resume accepts (MAY_CHANGE fields,
    num_epochs, a number written as an int), different for any field of the math."""
    base = run_record.run_identity(smoke.get_config())
    same = smoke.get_config()
    same.workers, same.accum_steps, same.num_epochs, same.parallelism = 3, 2, 9.0, "pmap"
    same.checkpoint_every_steps, same.data_dir, same.base_lr = 1, "/elsewhere", 0.1
    assert run_record.run_identity(same) == base
    for field, value in [("lr_multiplier", 100.0), ("seed", 1), ("decay_epochs", (1.0,))]:
        other = smoke.get_config()
        other[field] = value
        assert run_record.run_identity(other) != base, field


def damage_silently(workdir: Path, step: int) -> None:
    """One bit of one parameter of checkpoint `step` flipped, the checkpoint still
    readable: its arrays written again by orbax (flipped bytes in its compressed data
    files would make it unreadable, or not, by where they fall)."""
    import orbax.checkpoint as ocp

    state = final_state(workdir, step)
    kernel = np.array(state["params"]["stem_conv"]["kernel"])
    kernel.view(np.uint32).flat[0] ^= 1
    state["params"]["stem_conv"]["kernel"] = kernel
    folder = workdir / "checkpoints" / str(step)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(folder / "state.damaged", state)
    checkpointer.wait_until_finished()
    shutil.rmtree(folder / "state")
    (folder / "state.damaged").rename(folder / "state")


def test_foreign_damaged_and_unreadable_checkpoints_are_set_aside(
    tmp_path, fashion_mnist_dir, straight
):
    """A copy of the uninterrupted run whose step 64 is replaced by a
    real foreign checkpoint (a run with lr_multiplier=100: the same shapes and seed),
    whose step 56 has one bit of a parameter flipped (readable, silently damaged) and
    whose step 48 cannot be parsed. The rerun passes over each with one warning line
    naming why, moves it to rejected_checkpoints/, resumes from step 40, saves 48..64
    anew and ends with the uninterrupted run's params_sha256."""
    foreign = tmp_path / "foreign"
    out = run(
        foreign,
        fashion_mnist_dir,
        "--config.num_epochs=0.5",
        "--config.decay_epochs=()",
        "--config.lr_multiplier=100",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    workdir = tmp_path / "wd"
    shutil.copytree(straight, workdir)
    (workdir / "result.json").unlink()
    ckpts = workdir / "checkpoints"
    shutil.rmtree(ckpts / "64")
    shutil.copytree(foreign / "checkpoints" / "8", ckpts / "64")
    damage_silently(workdir, 56)
    for f in (ckpts / "48" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")

    out = run(workdir, fashion_mnist_dir, *LONGER)
    assert out.returncode == 0, out.stderr[-3000:]
    moved = [x for x in out.stderr.splitlines() if "moved to" in x]
    assert len(moved) == 3, out.stderr[-3000:]
    for line, step, why in zip(
        moved,
        (64, 56, 48),
        ("was saved by another run", "is damaged (its arrays do not match", "cannot be read"),
        strict=True,
    ):
        assert f"checkpoint at step {step} {why}" in line, line
        assert f"rejected_checkpoints/{step}; resuming from step 40" in line, line
    assert "resuming at step 40" in out.stderr
    assert sha(workdir) == sha(straight)
    assert {48, 56, 64} <= set(checkpoint_steps(workdir))
    assert sorted(os.listdir(workdir / "rejected_checkpoints")) == ["48", "56", "64"]


def test_a_diverging_run_stops_with_good_checkpoints_and_resumes_skipping(
    tmp_path, fashion_mnist_dir
):
    """A learning rate that overflows (lr_multiplier=1e8, a checkpoint
    every step) stops the run at the first non-finite loss, gradient or update with one
    line naming the step, every checkpoint kept (all finite: the check covers the
    updated state too, and the line lists the checkpoints after the last save finished)
    and the fix; the fix, the same command with skip_nonfinite=True, resumes from the
    newest checkpoint (a field that may change) and ends "done" with the skipped updates
    counted in its warnings, its done line and result.json."""
    diverge = ("--config.lr_multiplier=1e8", "--config.checkpoint_every_steps=1")
    out = run(tmp_path, fashion_mnist_dir, *diverge)
    assert out.returncode == 1, out.stderr[-3000:]
    line = one_error(out, "non-finite loss, gradient or update at step ")
    assert foreign_lines(out.stdout + out.stderr) == []
    step = int(line.split(" at step ")[1].split()[0])
    kept = readable_checkpoints(tmp_path)
    assert kept and max(kept) < step, (kept, line)
    assert f"checkpoints at steps {kept} in " in line, line
    assert f"--config.skip_nonfinite=True to resume from step {max(kept)} " in line, line
    for s in kept:
        leaves = jax.tree.leaves(final_state(tmp_path, s))
        assert all(np.isfinite(np.asarray(x)).all() for x in leaves), s
    assert not (tmp_path / "result.json").exists()

    out = run(tmp_path, fashion_mnist_dir, *diverge, "--config.skip_nonfinite=True")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming at step {max(kept)}" in out.stderr
    skipped = result(tmp_path)["skipped_steps"]
    assert skipped > 0
    assert f"done, {skipped} of 32 updates skipped (non-finite): top-1 error" in out.stdout
    assert f"{skipped} of 32 updates skipped so far" in out.stderr
    assert foreign_lines(out.stdout + out.stderr) == []


def test_sigterm_during_start_up_is_one_line_and_releases_the_lock(tmp_path, fashion_mnist_dir):
    """A SIGTERM while the run starts (its lock taken, no step yet) is
    the preemption line on stdout, exit 0 (the sweep resumes such a run), nothing on
    stderr, and the lock released for the rerun."""
    proc = start(tmp_path, fashion_mnist_dir)
    lock = tmp_path / WorkdirLock.NAME
    deadline = time.time() + 120
    while not lock.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert out.startswith("preempted (SIGTERM) before the first step") and out.count("\n") == 1
    assert err == "" and not lock.exists() and checkpoint_steps(tmp_path) == []


def test_a_record_older_than_a_field_resumes_only_at_the_fields_old_value():
    old = json.loads(json.dumps(smoke.get_config().to_dict()))
    for field in run_record.BEFORE_FIELD:
        del old[field]
    same = smoke.get_config()
    same.reduction = "fast"  # the old records' math (exact is the default now)
    run_record.check_resume(old, same, 16, 16)
    higher = smoke.get_config()
    higher.lr_multiplier, higher.reduction = 8.0, "exact"
    with pytest.raises(ConfigError) as e:
        run_record.check_resume(old, higher, 16, 16)
    assert str(e.value).count("\n") == 0
    for words in ("lr_multiplier=1.0 (this config: 8.0)", "--config.reduction=fast"):
        assert words in str(e.value)
    del old["momentum"]  # a math field the record should have: nothing to compare it with
    with pytest.raises(ConfigError, match="has no field momentum, so what its run was"):
        run_record.check_resume(old, smoke.get_config(), 16, 16)


def make_folder(root: Path, bad: bool) -> None:
    """Two classes of real JPEGs; with `bad`, the files a user's folder really holds."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", 8), ("val", 4)):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = rng.integers(0, 255, (24, 32, 3), dtype=np.uint8)
                buf = io.BytesIO()
                Image.fromarray(pixels).save(buf, format="JPEG" if i % 4 else "PNG")
                (root / split / c / f"{i}.jpg").write_bytes(buf.getvalue())  # some PNGs
    if bad:
        good = (root / "train" / "a" / "1.jpg").read_bytes()
        (root / "train" / "a" / "9.jpg").write_bytes(good[: len(good) // 3])
        (root / "train" / "b" / "README.txt").write_text("images of class b\n")
        (root / "val" / "a" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1" + bytes(64))


def prepare_pets(root, data_dir, *flags) -> list[str]:
    """The prepare command of the image folder `root` as dataset image_folder/pets."""
    return [
        sys.executable,
        "-m",
        "largebatch_jax.data.prepare",
        "image_folder",
        f"--root={root}",
        "--name=pets",
        f"--data_dir={data_dir}",
        *flags,
    ]


def prepare(root, data_dir, *flags):
    return call(prepare_pets(root, data_dir, *flags), timeout=300)


def records(data_dir, split):
    source = sources.load_source("image_folder/pets", split, str(data_dir))
    return [
        (r["file_name"], r["label"], bytes(r["image"]))
        for r in map(source.__getitem__, range(len(source)))
    ]


def test_prepare_leaves_out_undecodable_files_and_refuses_a_changed_folder(tmp_path):
    """A truncated JPEG, README.txt and .DS_Store are left out and named in one
    line (the PNGs named .jpg decode, and stay); the prepared data is exactly that of the
    folder without them; a changed folder is refused until --overwrite."""
    make_folder(tmp_path / "bad", bad=True)
    out = prepare(tmp_path / "bad", tmp_path / "tfds")
    assert out.returncode == 0, out.stderr[-3000:]
    (summary,) = [x for x in out.stdout.splitlines() if "left out" in x]
    assert "24 images in 2 classes" in summary and "left out 3 file(s)" in summary
    for name in ("train/a/9.jpg (OSError", "train/b/README.txt", "val/a/.DS_Store"):
        assert name in summary, summary
    make_folder(tmp_path / "clean", bad=False)
    prepare(tmp_path / "clean", tmp_path / "tfds_clean").check_returncode()
    for split in ("train", "validation"):
        assert records(tmp_path / "tfds", split) == records(tmp_path / "tfds_clean", split)

    again = prepare(tmp_path / "bad", tmp_path / "tfds")  # unchanged: reused
    assert again.returncode == 0, again.stderr[-3000:]
    shutil.copy(tmp_path / "bad/train/a/1.jpg", tmp_path / "bad/train/a/10.jpg")
    refused = prepare(tmp_path / "bad", tmp_path / "tfds")
    assert refused.returncode == 2
    one_error(refused, "changed since it was prepared", "--overwrite")
    assert len(records(tmp_path / "tfds", "train")) == 16  # the old copy, untouched
    redone = prepare(tmp_path / "bad", tmp_path / "tfds", "--overwrite")
    assert redone.returncode == 0, redone.stderr[-3000:]
    assert len(records(tmp_path / "tfds", "train")) == 17


BAD_FOLDERS = {
    # case: (change to a good folder, words of the one error line)
    "val_classes_empty": ("rm val/a/* val/b/*", ["val/ holds no image", "add images"]),
    "class_only_in_val": ("mkdir val/c && cp val/a/1.jpg val/c/", ["val/c/ is a class that"]),
    "empty_train_class": ("mkdir train/c", ["train/c/ holds no image", "cannot be learned"]),
    "name_outside": ("--name=../../x", ["'../../x' is not a plain name", "--name=pets"]),
}


@pytest.mark.parametrize("case", list(BAD_FOLDERS))
def test_a_bad_image_folder_is_one_line(tmp_path, case):
    """An image folder that cannot make a dataset (a val/ of empty
    class folders, a class only in val/, an empty class folder in train/) or a --name
    that would leave data_dir: exit 2, one line naming it and the fix, nothing written."""
    make_folder(tmp_path / "pets", bad=False)
    change, words = BAD_FOLDERS[case]
    flags = [change] if change.startswith("--") else []
    if not flags:
        subprocess.run(["bash", "-c", change], cwd=tmp_path / "pets", check=True)
    out = prepare(tmp_path / "pets", tmp_path / "tfds", *flags)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.count("\n") == 1, out.stderr
    one_error(out, *words)
    assert not (tmp_path / "tfds" / "image_folder").exists() or not any(
        (tmp_path / "tfds" / "image_folder").rglob("dataset_info.json")
    )
    assert not (tmp_path / "x").exists()


def test_prepare_reports_empty_val_classes_and_decodes_16_bit_pngs(tmp_path):
    """A class with no validation image is named in the summary line;
    a 16-bit grayscale PNG trains as its own pixels (its 8 high bits), not as white."""
    import io

    from PIL import Image

    from largebatch_jax.data import transforms

    make_folder(tmp_path / "pets", bad=False)
    for f in (tmp_path / "pets" / "val" / "b").iterdir():
        f.unlink()
    out = prepare(tmp_path / "pets", tmp_path / "tfds")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "(1 class(es) with no validation image: b)" in out.stdout, out.stdout
    assert "prepared image_folder/pets in " in out.stdout and out.stderr == "", out.stderr

    ramp = (np.arange(32 * 32, dtype=np.uint32).reshape(32, 32) * 64).astype(np.uint16)
    buf = io.BytesIO()
    Image.fromarray(ramp).save(buf, format="PNG")
    assert Image.open(io.BytesIO(buf.getvalue())).mode.startswith("I")
    pixels = np.asarray(transforms._pil_rgb(buf.getvalue()))
    assert pixels.shape == (32, 32, 3)
    np.testing.assert_array_equal(pixels[..., 0], (ramp >> 8).astype(np.uint8))


@pytest.mark.skipif(UNSHARE is None, reason="needs unshare(1) to mount a read-only tmpfs")
def test_prepare_into_a_read_only_data_dir_is_one_line(tmp_path):
    """`--data_dir` on a read-only file system: exit 2, one line."""
    make_folder(tmp_path / "pets", bad=False)
    ro = tmp_path / "ro"
    ro.mkdir()
    main = shlex.join(prepare_pets(tmp_path / "pets", f"{ro}/tfds"))
    script = f"mount -t tmpfs -o ro,size=1m tmpfs {ro} || exit 99\n{main}"
    done = call([UNSHARE, "-r", "-m", "bash", "-c", script], timeout=300)
    if done.returncode == 99:
        pytest.skip("cannot mount a tmpfs in a user namespace here")
    assert done.returncode == 2, done.stderr[-3000:]
    one_error(done, f"--data_dir={ro}/tfds is not writable (Read-only file system)")
    assert done.stderr.count("\n") == 1 and done.stdout == "", done.stderr


def test_concurrent_and_killed_prepares(tmp_path):
    """A second prepare of a dataset being prepared stops with one
    line; a prepare killed (SIGKILL) half-way leaves its lock and tfds's incomplete.*
    folder, which the next prepare replaces and removes, one line each, before it
    prepares the dataset whole."""
    make_folder(tmp_path / "pets", bad=False)
    first = subprocess.Popen(
        prepare_pets(tmp_path / "pets", tmp_path / "tfds"),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    folder = tmp_path / "tfds" / "image_folder" / "pets"
    deadline = time.time() + 120
    while not list(folder.glob("incomplete.*")) and time.time() < deadline:
        assert first.poll() is None, first.communicate()
        time.sleep(0.01)
    first.send_signal(signal.SIGSTOP)  # held half-way, as a slow prepare would be
    second = prepare(tmp_path / "pets", tmp_path / "tfds")
    assert second.returncode == 2, second.stderr[-3000:]
    one_error(second, f"{folder} is being prepared by another process (pid {first.pid}")
    first.kill()
    first.communicate()
    assert list(folder.glob("incomplete.*"))
    again = prepare(tmp_path / "pets", tmp_path / "tfds")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "removed 1 unfinished folder(s) of an interrupted prepare" in again.stdout
    assert not list(folder.glob("incomplete.*"))
    assert again.stderr.startswith("warning: replaced the stale lock ")  # the killed one's
    assert f" of pid {first.pid} " in again.stderr and again.stderr.count("\n") == 1
    assert len(records(tmp_path / "tfds", "train")) == 16


FOLDER_RUN = (
    "--config.dataset=image_folder/pets",
    "--config.num_classes=2",
    "--config.channels=3",
    "--config.image_size=16",
    "--config.batch_size=16",
    "--config.bn_group_size=2",
    "--config.base_batch_size=8",
    "--config.train_subset=0",
    "--config.eval_subset=0",
    "--config.eval_batch_size=16",  # n=2 images per device, as exact evaluation needs
    "--config.eval_every_epochs=1.0",
    "--config.checkpoint_every_steps=1",
    "--config.num_epochs=3.0",
    "--config.decay_epochs=(2.0,)",
    "--config.warmup_epochs=1.0",
)


def test_an_undecodable_validation_image_keeps_the_checkpoints(tmp_path):
    """In training: a bad validation image stops the run at its first
    evaluation with one line naming the record and its file; the checkpoints before it
    stay, and after the image is fixed the rerun ends as a run that never met it."""
    make_folder(tmp_path / "pets", bad=False)
    prepare(tmp_path / "pets", tmp_path / "clean").check_returncode()
    reference = run(tmp_path / "ref", tmp_path / "clean", *FOLDER_RUN)
    assert reference.returncode == 0, reference.stderr[-3000:]

    good = (tmp_path / "pets/val/b/1.jpg").read_bytes()
    (tmp_path / "pets/val/b/1.jpg").write_bytes(good[: len(good) // 2])
    prepare_with_a_bad_record(tmp_path / "pets", tmp_path / "tfds", "pets", "val/b/1.jpg")
    out = run(tmp_path / "wd", tmp_path / "tfds", *FOLDER_RUN)
    assert out.returncode == 2, out.stderr[-3000:]
    one_error(out, "validation record", "(b/1.jpg) cannot be decoded")
    kept = readable_checkpoints(tmp_path / "wd")
    assert kept == [0]  # the evaluation of step 1 comes before that step's checkpoint

    (tmp_path / "pets/val/b/1.jpg").write_bytes(good)
    redone = prepare(tmp_path / "pets", tmp_path / "tfds", "--overwrite")
    assert redone.returncode == 0, redone.stderr[-3000:]
    out = run(tmp_path / "wd", tmp_path / "tfds", *FOLDER_RUN)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sha(tmp_path / "wd") == sha(tmp_path / "ref")


def test_second_run_in_a_workdir_is_refused_and_sigint_keeps_every_checkpoint(
    tmp_path, fashion_mnist_dir, straight
):
    """Defects 4 and 5: a second start in a workdir in use stops at once naming the run;
    SIGINT during a checkpoint save waits for it and exits 130; the rerun is exact."""
    workdir = tmp_path / "wd"
    first = start(workdir, fashion_mnist_dir, *LONGER)
    wait_for_checkpoint(first, workdir, 8)
    first.send_signal(signal.SIGSTOP)  # held while the second starts (the run is short)
    try:
        second = run(workdir, fashion_mnist_dir, *LONGER, timeout=120)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 2, second.stderr[-3000:]
    one_error(second, "is in use by another run", f"pid {first.pid} on ")
    assert first.poll() is None  # the running one goes on

    folder_ = workdir / "checkpoints"
    deadline = time.time() + 120
    while time.time() < deadline:  # SIGINT the moment a save is in flight
        if any("tmp" in p.name for p in folder_.iterdir()) or 40 in checkpoint_steps(workdir):
            break
        time.sleep(0.002)
    first.send_signal(signal.SIGINT)
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 130, stderr[-3000:]
    lines = error_lines(stderr)
    assert len(lines) == 1 and "interrupted (SIGINT)" in lines[0], stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    kept = readable_checkpoints(workdir)
    assert f"checkpoints at steps {kept}" in lines[0]
    assert not (workdir / WorkdirLock.NAME).exists()
    out = run(workdir, fashion_mnist_dir, *LONGER)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming at step {max(kept)}" in out.stderr
    assert sha(workdir) == sha(straight)


def test_lock_staleness(tmp_path):
    """A lock whose process is gone (this host) or whose heartbeat stopped (any host) is
    replaced; a live one, or another host's fresh one, is not."""
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(gone.stdout)
    lock = WorkdirLock(tmp_path)
    lock.path.write_text(json.dumps({"pid": dead_pid, "host": lock.me["host"], "since": "x"}))
    assert "stale lock" in lock.acquire()
    with pytest.raises(WorkdirError, match=r"in use by another run \(pid \d+ on "):
        WorkdirLock(tmp_path).acquire()  # this process holds it
    old = time.time() - 120
    os.utime(lock.path, (old, old))  # a stopped run: on its own host the pid decides
    with pytest.raises(WorkdirError, match="in use by another run"):
        WorkdirLock(tmp_path).acquire()
    lock.release()
    assert not lock.path.exists()
    lock.path.write_text(json.dumps({"pid": 1, "host": "elsewhere", "since": "x"}))
    with pytest.raises(WorkdirError, match="pid 1 on elsewhere, since x"):
        WorkdirLock(tmp_path).acquire()
    old = time.time() - 120
    os.utime(lock.path, (old, old))  # elsewhere's heartbeat stopped two minutes ago
    other = WorkdirLock(tmp_path)
    assert "stale lock" in other.acquire()
    other.release()


class _Ended(BaseException):
    """Where a simulated SIGTERM ends the process (nothing after it runs)."""


def _ended_at_line(n: int, action, folder: Path, token: str) -> list[str] | None:
    """Run `action`; at the n-th line it executes in lock.py, do what main.py's SIGTERM
    handler does before `os._exit` (`release_held`) and return what the folder then holds
    of this lock (the lock file if it carries `token`, its draft). None: `action` ran
    fewer lines."""
    count, found = 0, None

    def in_lock(frame, event, arg):
        nonlocal count, found
        if event == "line":
            count += 1
            if count == n:
                sys.settrace(None)
                lock_module.release_held()
                found = [
                    p.name for p in folder.iterdir() if token in p.read_text() or token in p.name
                ]
                raise _Ended
        return in_lock

    sys.settrace(lambda f, e, a: in_lock if f.f_code.co_filename == lock_module.__file__ else None)
    try:
        action()
    except _Ended:
        return found
    finally:
        sys.settrace(None)
    return None


def test_a_sigterm_at_any_instant_of_taking_or_releasing_the_lock_leaves_none(tmp_path):
    """main.py ends a run stopped outside the loop with `release_held()` and `os._exit`,
    wherever the main thread is. Stopped at each line of taking the lock (in a free
    workdir, and in one with a stale lock) and of releasing it, the process leaves
    neither its lock file nor a draft of it."""
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = {"pid": int(gone.stdout), "host": WorkdirLock(tmp_path).me["host"], "since": "x"}
    cases = {
        "acquire": (lambda lock: None, lambda lock: lock.acquire()),
        "acquire over a stale lock": (
            lambda lock: lock.path.write_text(json.dumps(stale)),
            lambda lock: lock.acquire(),
        ),
        "release": (lambda lock: lock.acquire(), lambda lock: lock.release()),
    }
    for name, (before, action) in cases.items():
        n = 0
        while True:
            n += 1
            folder = tmp_path / f"{name}_{n}"
            folder.mkdir()
            lock = WorkdirLock(folder)
            before(lock)
            left = _ended_at_line(n, functools.partial(action, lock), folder, lock.token())
            lock.release()
            assert lock_module._HELD == []
            if left is None:
                break
            assert left == [], (name, n, left)
        assert n > 5, (name, n)  # the trace saw the lock's code


def test_the_lock_is_taken_where_a_link_fails(tmp_path, monkeypatch):
    """NFS may answer EEXIST to a retried link that did succeed: the lock is ours then.
    A filesystem without hard links (EPERM) gets the lock by O_EXCL. Either way a second
    run is refused and release removes the file."""
    real_link = os.link

    def link_then_eexist(src, dst):
        real_link(src, dst)
        raise FileExistsError(dst)

    def no_links(src, dst):
        raise PermissionError(dst)

    for link in (link_then_eexist, no_links):
        monkeypatch.setattr(os, "link", link)
        lock = WorkdirLock(tmp_path)
        assert lock.acquire() is None
        assert json.loads(lock.path.read_text())["token"] == lock.token()
        with pytest.raises(WorkdirError, match="in use by another run"):
            WorkdirLock(tmp_path).acquire()
        lock.release()
        assert list(tmp_path.iterdir()) == [], link


def test_a_lock_naming_a_reused_pid_or_torn_is_stale(tmp_path):
    """pids are reused (in containers after every restart): a lock whose pid now belongs
    to another, innocent process (same pid, another start time) is stale, and so is an
    empty or torn lock a few seconds old; the lock of the live process it names is not."""
    innocent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = process_start_time(innocent.pid)
        assert started is not None
        lock = WorkdirLock(tmp_path)
        holder = {"pid": innocent.pid, "host": lock.me["host"], "since": "x"}
        lock.path.write_text(json.dumps({**holder, "started": started}))
        with pytest.raises(WorkdirError, match=f"pid {innocent.pid} on"):
            lock.acquire()  # its own process is alive: a live run
        lock.path.write_text(json.dumps({**holder, "started": started - 1}))
        assert f"stale lock {lock.path} of pid {innocent.pid}" in lock.acquire()
        lock.release()
    finally:
        innocent.kill()
        innocent.wait()
    for torn in ("", '{"pid": 12'):
        lock = WorkdirLock(tmp_path)
        lock.path.write_text(torn)
        with pytest.raises(WorkdirError, match="being locked by another run this instant"):
            lock.acquire()  # being written this instant
        old = time.time() - 2 * WorkdirLock.TORN_SECONDS
        os.utime(lock.path, (old, old))
        assert "stale lock" in lock.acquire()
        lock.release()


def test_a_save_is_not_started_without_room_for_it(tmp_path, monkeypatch):
    """The full disk found before a save (one ENOSPC OSError, nothing written), not
    half-way through it in orbax's threads."""
    import errno

    import jax.numpy as jnp

    from largebatch_jax import checkpoint

    ckpt = checkpoint.Checkpointer(tmp_path / "checkpoints", keep=3)
    state = {"w": jnp.zeros((512, 1024))}  # 2 MiB
    total = shutil.disk_usage(tmp_path).total
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(total, 0, 4 << 20))
    assert ckpt.save(0, state, {"step": 0})
    ckpt.wait()
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(total, 0, 2 << 20))
    with pytest.raises(OSError) as e:
        ckpt.save(8, state, {"step": 8})
    assert e.value.errno == errno.ENOSPC and wd.is_disk_full(e.value)
    ckpt.close()
    assert ckpt.steps() == [0] and os.listdir(tmp_path / "checkpoints") == ["0"]


@pytest.mark.skipif(UNSHARE is None, reason="needs unshare(1) to mount a small tmpfs")
def test_disk_full_is_one_line_and_the_rerun_is_exact(tmp_path, fashion_mnist_dir, straight):
    """The workdir on a 64 MiB tmpfs (a private mount namespace) that a file
    fills once checkpoint 16 exists (the run held meanwhile, so that the fault lands
    between two saves: the next write finds the disk full); after the fault, the file is
    removed and the same command resumes, in the same namespace, to the uninterrupted
    run's parameters."""
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir(), out.mkdir()
    main = shlex.join(command(f"{mnt}/wd", fashion_mnist_dir, *LONGER))
    script = f"""
set -u
mount -t tmpfs -o size=64m tmpfs {mnt} || exit 99
{main} > {out}/first.out 2> {out}/first.err &
pid=$!
while [ ! -d {mnt}/wd/checkpoints/16 ]; do sleep 0.02; done
kill -STOP $pid  # the disk fills between two saves, as another job's files would fill it
dd if=/dev/zero of={mnt}/fill bs=64k 2>/dev/null
kill -CONT $pid
wait $pid
echo $? > {out}/first.rc
ls {mnt}/wd/checkpoints > {out}/after_fault.ls
rm -f {mnt}/fill
{main} > {out}/second.out 2> {out}/second.err
echo $? > {out}/second.rc
cp {mnt}/wd/result.json {mnt}/wd/metrics.jsonl {out}/
"""
    done = subprocess.run(
        [UNSHARE, "-r", "-m", "bash", "-c", script], cwd=ROOT, env=env(), timeout=600
    )
    if done.returncode == 99:
        pytest.skip("cannot mount a tmpfs in a user namespace here")
    first_err = (out / "first.err").read_text()
    assert (out / "first.rc").read_text().strip() == "2", first_err[-3000:]
    lines = error_lines(first_err)
    assert len(lines) == 1 and "no space left on the device" in lines[0], first_err[-3000:]
    assert "Traceback" not in first_err, first_err[-3000:]
    kept = sorted(int(x) for x in (out / "after_fault.ls").read_text().split() if x.isdigit())
    assert 16 in kept and f"checkpoints at steps {kept}" in lines[0]
    second_err = (out / "second.err").read_text()
    assert (out / "second.rc").read_text().strip() == "0", second_err[-3000:]
    assert json.loads((out / "result.json").read_text())["params_sha256"] == sha(straight)
    assert without_timing(read_metrics(out)) == without_timing(read_metrics(straight))


def test_corrupt_or_missing_prepared_files_are_one_line(tmp_path, fashion_mnist_dir):
    """A deleted or truncated array_record shard (without the decoded cache
    that would hide it) is the one-line 'cannot be read' error with the command that
    prepares it again; that command (--overwrite) then makes it whole."""
    data_dir = tmp_path / "tfds"
    shutil.copytree(fashion_mnist_dir, data_dir)
    for cache in data_dir.rglob("decoded-*.npz"):
        cache.unlink()
    (shard,) = [p for p in data_dir.rglob("*test.array_record*")]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    out = run(tmp_path / "wd", data_dir, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    line = one_error(out, "fashion_mnist", "split 'test' cannot be read", "--overwrite`")
    shard.unlink()
    out = run(tmp_path / "wd", data_dir, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    one_error(out, "split 'test' cannot be read")
    fix = line.split("`")[1]
    assert fix.startswith("python -m largebatch_jax.data.prepare fashion_mnist")
    subprocess.run(
        [sys.executable, *fix.split()[1:]],
        cwd=ROOT,
        env=env(),
        check=True,
        timeout=300,
        capture_output=True,
    )
    assert len(sources.load_source("fashion_mnist", "test", str(data_dir))) == 10000


BAD_FILES = {
    "typo": (
        ["--config=configs/smoke.py", "--config.batch_szie=64"],
        "no field 'batch_szie' (did you mean 'batch_size'?)",
    ),
    "missing": (["--config=configs/nope.py"], "no such config file 'configs/nope.py'"),
    "syntax": (None, "syntax error in"),
    "value": (["--config=configs/smoke.py", "--config.batch_size=abc"], "--config.batch_size=abc"),
    "argument": (
        ["--config=configs/smoke.py:batch_size=64"],
        "takes no FIELD=VALUE after ':'; use --config.FIELD=VALUE",
    ),
    "override": (
        ["--config=configs/imagenet.py:batch_size=abc"],
        "batch_size='abc' is not an int like the default 256.",
    ),
    "infinite": (
        ["--config=configs/smoke.py", "--config.base_lr=inf"],
        "config.base_lr=inf must be a finite number.",
    ),
    "huge": (
        ["--config=configs/smoke.py", "--config.num_epochs=1e300", "--config.seed=99999999999"],
        "config.seed=99999999999 must be in [0, 2**31)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_config_files_and_fields_are_one_line(tmp_path, case):
    """A typo in a field, a missing file, a syntax error, a value of the wrong type, an
    infinite rate, a seed past 32 bits: one line, exit 2, before anything is built."""
    argv, words = BAD_FILES[case]
    if argv is None:
        bad = tmp_path / "broken.py"
        bad.write_text("def get_config(:\n    pass\n")
        argv = [f"--config={bad}"]
    out = call([sys.executable, "main.py", *argv, f"--workdir={tmp_path / 'wd'}"], timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    one_error(out, words)
    assert not (tmp_path / "wd").exists()


@pytest.mark.parametrize("case", ["empty", "checkpoints_a_file", "record_not_utf8", "gs_url"])
def test_bad_workdirs_are_one_line(tmp_path, fashion_mnist_dir, case):
    """An empty --workdir (not the current directory), a file where the checkpoints go,
    a run record that is not UTF-8, a gs:// URL (no local folder 'gs:'): one line, exit 2,
    nothing written."""
    workdir = tmp_path / "wd"
    workdir.mkdir()
    if case == "checkpoints_a_file":
        (workdir / "checkpoints").write_text("not a folder")
    elif case == "record_not_utf8":
        (workdir / run_record.RECORD).write_bytes(b"\xff\xfe not json")
    given = {"empty": "", "gs_url": "gs://bucket/rn50_8k"}.get(case, workdir)
    out = run(given, fashion_mnist_dir, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    one_error(
        out,
        {
            "empty": "--workdir is empty: name the run's folder",
            "checkpoints_a_file": "checkpoints is a file, where the run keeps its checkpoints",
            "record_not_utf8": f"{run_record.RECORD} is not readable",
            "gs_url": "--workdir=gs://bucket/rn50_8k: a gs:// URL cannot be a workdir: a run "
            "takes its lock with an atomic exclusive create",
        }[case],
    )
    assert not (ROOT / "checkpoints").exists() and not (ROOT / "metrics.jsonl").exists()
    assert not (ROOT / "gs:").exists()
    if case == "record_not_utf8":  # left as it was, nothing trained
        assert (workdir / run_record.RECORD).read_bytes() == b"\xff\xfe not json"
        assert not checkpoint_steps(workdir)
    else:
        expected = ["checkpoints"] if case == "checkpoints_a_file" else []
        assert [p.name for p in workdir.iterdir()] == expected


def test_a_workdir_on_a_mount_of_an_object_store_is_refused(tmp_path):
    """gcsfuse (and the like) has no atomic folder rename nor hard link: refused, by the
    type of the mount that holds the folder (a link into it too); an NFS share is not."""
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/vda1 / ext4 rw 0 0\n"
        "rn50-bucket /mnt/gcs\\040bucket fuse.gcsfuse rw,nosuid 0 0\n"
        "10.0.0.2:/share /mnt/shared nfs4 rw 0 0\n"
    )
    with pytest.raises(WorkdirError) as error:
        wd.resolve("/mnt/gcs bucket/rn50/run1", str(mounts))
    assert "is on a fuse.gcsfuse mount of an object store" in str(error.value)
    assert "Filestore share" in str(error.value) and "\n" not in str(error.value)
    assert wd.resolve("/mnt/shared/rn50", str(mounts)) == Path("/mnt/shared/rn50")
    assert wd.resolve("/mnt/gcsx/rn50", str(mounts)) == Path("/mnt/gcsx/rn50")
    assert wd.mount_type(Path("/mnt/gcs bucket"), str(mounts)) == "fuse.gcsfuse"


def test_a_finished_run_started_again_returns_at_once(tmp_path, fashion_mnist_dir, straight):
    """A requeued or repeated job of a finished run ends at once with its result: exit 0,
    before any backend starts or any other process is waited for (here process 0 of 2,
    whose process 1 never comes), nothing written; a changed config still goes the full
    way (and is refused there)."""
    finished = tmp_path / "finished"
    shutil.copytree(straight, finished)
    before = {p.name: p.read_bytes() for p in finished.iterdir() if p.is_file()}
    port = launch.free_port()
    alone = [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", "--process_id=0"]
    began = time.time()
    out = run(finished, fashion_mnist_dir, *LONGER, *alone, "--initialization_timeout_seconds=60")
    took = time.time() - began
    print(f"a finished run started again: exit {out.returncode} after {took:.1f} s")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("done: top-1 error") and out.stdout.count("\n") == 1
    assert "joining" not in out.stderr and "devices=" not in out.stderr
    assert took < 30
    assert {p.name: p.read_bytes() for p in finished.iterdir() if p.is_file()} == before
    out = run(finished, fashion_mnist_dir, *LONGER, "--config.seed=1", timeout=120)
    assert out.returncode == 2
    one_error(out, "seed=0 (this config: 1)")


def test_tilde_workdir_and_data_dir_are_expanded(tmp_path):
    """`--workdir=~/x` is $HOME/x (no directory named '~'), data_dir too."""
    home = tmp_path / "home"
    home.mkdir()
    out = run("~/wd", "~/no_data", extra_env={"HOME": str(home)}, timeout=120)
    assert out.returncode == 2
    one_error(out, f"is not prepared in {home}/no_data")
    assert (home / "wd").is_dir() and not (ROOT / "~").exists()
