"""The run configs (`python main.py --config=configs/NAME.py`), a package too: installed
with largebatch_jax, `from configs import cifar10` works outside the checkout (a notebook,
a restarted runtime)."""
