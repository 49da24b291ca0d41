"""Writes tests/fixtures/zoo_preprocess.npz: larq-zoo 2.4's preprocess_input
on two seeded random images (every 4th output pixel), the reference that
tests/test_zoo_api.py checks tapehook.zoo.preprocess_input against.

Run in the larq side environment (larq 0.14, larq-zoo 2.4 on tf-keras):
    TF_USE_LEGACY_KERAS=1 python scripts/zoo_preprocess_reference.py OUT.npz
"""

import sys

import larq_zoo
import numpy as np

# (name, shape): a small image (upscaled) and a large one (downscaled).
IMAGES = (("wide", (50, 70, 3)), ("tall", (300, 231, 3)))


def images():
    rng = np.random.RandomState(0)
    return {name: rng.randint(0, 256, size=shape).astype(np.uint8) for name, shape in IMAGES}


def main(path):
    out = {name: larq_zoo.preprocess_input(img)[::4, ::4] for name, img in images().items()}
    np.savez_compressed(path, **{k: v.astype(np.float32) for k, v in out.items()})


if __name__ == "__main__":
    main(sys.argv[1])
