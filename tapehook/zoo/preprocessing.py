"""ImageNet preprocessing as larq-zoo 2.4 applies it, and decoding of predictions.

Evaluation: a central square of side ``size / (size + 32)`` of the shorter
image side, resized to ``size`` x ``size`` with TF 1's bicubic resize, then
each channel normalized by ImageNet's mean and standard deviation (on the
0-255 scale). Training (``train_zoo.py``): a random crop of 8-100 % of the
area with aspect ratio 3/4-4/3, the same resize, a random horizontal flip and
the same normalization (larq-zoo's EfficientNet-style recipe). The zoo's
weights were trained on exactly these inputs.
"""

import keras
import numpy as np
import tensorflow as tf

from tapehook.errors import TapehookError

IMAGE_SIZE = 224
CROP_PADDING = 32
MEAN_RGB = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STDDEV_RGB = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def _resize(image, size):
    # TF 1's bicubic (no half-pixel centers), which larq-zoo trained with.
    return tf.compat.v1.image.resize_bicubic(image[None], [size, size])[0]


def _normalize(image):
    return (tf.cast(image, tf.float32) - MEAN_RGB) / STDDEV_RGB


def center_crop(image, size=IMAGE_SIZE):
    """The central crop of an HxWx3 image, resized to size x size (float32)."""
    shape = tf.shape(image)
    side = tf.cast(
        size / (size + CROP_PADDING) * tf.cast(tf.minimum(shape[0], shape[1]), tf.float32),
        tf.int32,
    )
    top = (shape[0] - side + 1) // 2
    left = (shape[1] - side + 1) // 2
    crop = tf.image.crop_to_bounding_box(image, top, left, side, side)
    return tf.reshape(_resize(crop, size), [size, size, 3])


def training_input(image, size=IMAGE_SIZE, seed=None):
    """A training crop of an HxWx3 image: random area 8-100 %, aspect ratio
    3/4-4/3 (the whole-image center crop when no box fits in 10 tries),
    resized to size x size, flipped left-right half the time; normalized."""
    shape = tf.shape(image)
    begin, extent, _ = tf.image.sample_distorted_bounding_box(
        shape,
        bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]),
        min_object_covered=0.1,
        aspect_ratio_range=(3 / 4, 4 / 3),
        area_range=(0.08, 1.0),
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
        seed=seed,
    )
    crop = tf.slice(image, begin, extent)
    whole = tf.reduce_all(tf.equal(tf.shape(crop)[:2], shape[:2]))
    out = tf.cond(
        whole,
        lambda: center_crop(image, size),
        lambda: tf.reshape(_resize(crop, size), [size, size, 3]),
    )
    return _normalize(tf.image.random_flip_left_right(out, seed=seed))


def evaluation_input(image, size=IMAGE_SIZE):
    """The normalized central crop of an HxWx3 image at size x size."""
    return _normalize(center_crop(image, size))


def preprocess_input(image):
    """larq-zoo's ``preprocess_input``: one HxWx3 image (0-255 RGB, any size)
    to the 224x224x3 float32 input of every zoo model. Returns a NumPy array
    for a NumPy input, else a tensor."""
    if len(image.shape) != 3:
        raise TapehookError(
            f"preprocess_input takes one image of shape (height, width, 3), got shape "
            f"{tuple(image.shape)}; map it over a batch (tf.map_fn or a tf.data map)"
        )
    result = evaluation_input(tf.convert_to_tensor(image), IMAGE_SIZE)
    return result.numpy() if isinstance(image, np.ndarray) else result


def decode_predictions(preds, top=5, **kwargs):
    """The ``top`` ImageNet classes per row of ``preds`` as
    ``(class_name, class_description, score)``, as larq-zoo's (Keras's
    ImageNet index, downloaded once into Keras's cache)."""
    return keras.applications.imagenet_utils.decode_predictions(preds, top=top, **kwargs)
