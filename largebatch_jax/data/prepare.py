"""Prepare a dataset once, as array_record:

python -m largebatch_jax.data.prepare imagenet2012 --manual_dir=DIR [--data_dir=DIR]
python -m largebatch_jax.data.prepare fashion_mnist [--idx_dir=/usr/share/datasets/fashion-mnist]
python -m largebatch_jax.data.prepare cifar10
python -m largebatch_jax.data.prepare image_folder --root=ROOT --name=NAME

A dataset prepared before is reused; an image folder that changed since is refused, and
`--overwrite` prepares any dataset again from scratch (also the fix for corrupt files).
An image folder's files that do not decode as images are left out and named in one line.
"""

import sys

from absl import app, flags

from largebatch_jax.data import sources

flags.DEFINE_string(
    "data_dir", None, "tfds data_dir (default: $TFDS_DATA_DIR or ~/tensorflow_datasets)."
)
flags.DEFINE_string("manual_dir", None, "imagenet2012: folder with the ILSVRC2012 tars.")
flags.DEFINE_string("idx_dir", None, "fashion_mnist: folder with the IDX files.")
flags.DEFINE_string("root", None, "image_folder: folder with train/<class>/ and val/<class>/.")
flags.DEFINE_string("name", None, "image_folder: the dataset's name (default: root's name).")
flags.DEFINE_bool("overwrite", False, "Delete the prepared copy and prepare it again.")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) != 2:
        raise app.UsageError("name one dataset: imagenet2012, fashion_mnist, cifar10, image_folder")
    name = argv[1]
    if name == "image_folder" and FLAGS.name:
        name = sources.FOLDER_PREFIX + FLAGS.name
    try:
        where = sources.prepare(
            name,
            FLAGS.data_dir,
            manual_dir=FLAGS.manual_dir,
            idx_dir=FLAGS.idx_dir,
            root=FLAGS.root,
            overwrite=FLAGS.overwrite,
            report=lambda line: print(line, flush=True),
        )
    except (sources.DatasetNotPreparedError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"prepared {name} in {where}")


if __name__ == "__main__":
    app.run(main)
