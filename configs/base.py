"""Paper defaults (README, "Running the paper"): ResNet-50, kn=256 with n=32, Goyal et al. 2017.

Every field at its default from the one table of fields (`largebatch_jax/fields.py`, which
says what each is for). Every other config starts from this one and overrides a few
fields; the names follow the README's vocabulary (`batch_size` is kn, `bn_group_size` is n).
"""

import ml_collections

from largebatch_jax import fields


def get_config() -> ml_collections.ConfigDict:
    return fields.default_config()
