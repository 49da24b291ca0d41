"""What every zoo model shares: its input, its pooled head and its weights.

larq-zoo's conventions, kept so that its users' code and weight files work:
the input shape rules of ``keras.applications`` (224 px by default; any
size, or none, without the top), global pooling as a fixed-size average
pool where the image size is static, and weights loaded from larq-zoo's
Keras 2 HDF5 files by layer order.
"""

import dataclasses
import os
import pathlib

import keras

from tapehook import models
from tapehook.errors import TapehookError

RELEASES_URL = "https://github.com/larq/zoo/releases/download"
"""Where larq-zoo's release files live; tests point it at a local server."""


@dataclasses.dataclass(frozen=True)
class WeightsFile:
    """One larq-zoo release file: ``{RELEASES_URL}/{model}-{version}/{file}``."""

    model: str  # larq-zoo's release name, e.g. "quicknet_small"
    version: str  # e.g. "v1.0"
    file: str  # e.g. "quicknet_small_weights.h5"
    sha256: str

    @property
    def url(self) -> str:
        return f"{RELEASES_URL.rstrip('/')}/{self.model}-{self.version}/{self.file}"


def release_files(model, version, stem, top, notop, notop_version=None):
    """larq-zoo's two files of one model, ``<stem>_weights.h5`` and
    ``<stem>_weights_notop.h5``, by their SHA-256 (``top``, ``notop``).

    ``notop_version``: the release holding the file without the top, where
    larq-zoo published it again later (default ``version``).
    """
    return {
        "top": WeightsFile(model, version, f"{stem}_weights.h5", top),
        "notop": WeightsFile(model, notop_version or version, f"{stem}_weights_notop.h5", notop),
    }


def input_shape_for(input_shape, weights, include_top, default_size=224, min_size=32):
    """The model's input shape, by the rules of ``keras.applications``.

    With ImageNet weights and the top, only the default size; without the
    top, spatial dims may be None (any size).
    """
    default = (default_size, default_size, 3)
    if weights == "imagenet" and include_top:
        if input_shape is not None and tuple(input_shape) != default:
            raise TapehookError(
                f"weights='imagenet' with include_top=True needs input_shape={default} "
                f"(got {tuple(input_shape)}); pass include_top=False for other sizes"
            )
        return default
    if input_shape is None:
        return default if include_top else (None, None, 3)
    input_shape = tuple(input_shape)
    if len(input_shape) != 3:
        raise TapehookError(f"input_shape must be (height, width, channels), got {input_shape}")
    if include_top and None in input_shape:
        raise TapehookError(
            f"include_top=True needs a fixed input_shape, got {input_shape}; "
            "pass the image size, or include_top=False"
        )
    for dim in input_shape[:2]:
        if dim is not None and dim < min_size:
            raise TapehookError(
                f"input_shape {input_shape}: images must be at least {min_size} px for this model"
            )
    return input_shape


def model_input(input_shape, input_tensor, weights, include_top, num_classes, **sizes):
    """The Keras input tensor a zoo model starts from (``input_tensor`` if
    given); checks ``weights`` / ``num_classes`` as larq-zoo does."""
    if not (weights in ("imagenet", None) or os.path.exists(os.fspath(weights))):
        raise TapehookError(
            f"weights={weights!r}: pass None (random initialization), 'imagenet' "
            "(larq-zoo's release file) or the path of an existing weights file"
        )
    if weights == "imagenet" and include_top and num_classes != 1000:
        raise TapehookError(
            f"weights='imagenet' with include_top=True has 1000 classes, not "
            f"num_classes={num_classes}; pass include_top=False to put your own head on it"
        )
    shape = input_shape_for(input_shape, weights, include_top, **sizes)
    if input_tensor is None:
        return keras.Input(shape=shape)
    if not keras.backend.is_keras_tensor(input_tensor):
        return keras.Input(tensor=input_tensor, shape=shape)
    return input_tensor


def global_pool(x, name=None):
    """Average over the whole image: a fixed-size ``AveragePooling2D`` and
    ``Flatten`` where height and width are static (what LCE runs fastest,
    and larq-zoo's layers), ``GlobalAveragePooling2D`` otherwise."""
    height, width = x.shape[1:3]
    if height is None or width is None:
        return keras.layers.GlobalAveragePooling2D(name=name)(x)
    x = keras.layers.AveragePooling2D(
        pool_size=(height, width), name=f"{name}_pool" if name else None
    )(x)
    return keras.layers.Flatten(name=f"{name}_flatten" if name else None)(x)


def _cache_dir():
    # Read per call (Keras reads KERAS_HOME once, at import).
    return os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")


def download(entry: WeightsFile) -> str:
    """The local path of ``entry``, downloaded once into Keras's cache
    (``~/.keras/larq/models/<model>/``, as larq-zoo stores it) and checked
    against its SHA-256."""
    cache_subdir = os.path.join("larq", "models", entry.model)
    local = pathlib.Path(_cache_dir()) / cache_subdir / entry.file
    how = f"download {entry.url} yourself (SHA-256 {entry.sha256}) and pass its path as weights=..."
    try:
        # get_file falls back to /tmp/.keras when the folder does not exist yet.
        os.makedirs(_cache_dir(), exist_ok=True)
        path = keras.utils.get_file(
            fname=entry.file,
            origin=entry.url,
            cache_dir=_cache_dir(),
            cache_subdir=cache_subdir,
            file_hash=entry.sha256,
            hash_algorithm="sha256",
        )
    except Exception as e:  # offline, HTTP errors, or a bad hash
        if local.exists():  # never leave a file that failed its check
            local.unlink()
        raise TapehookError(f"could not fetch larq-zoo weights from {entry.url}: {e}; {how}") from e
    return path


def finish(inputs, outputs, name, weights, include_top, files):
    """The functional model, with ``weights`` loaded.

    ``files``: ``{"top": WeightsFile, "notop": WeightsFile}`` (either may be
    missing when larq-zoo released none).
    """
    model = keras.Model(inputs=inputs, outputs=outputs, name=name)
    # The zoo writes Keras's own batch norms, pools and adds; fast layers
    # decide, as for any model tapehook is in charge of (tapehook.models).
    models.decide_fast_layers(model)
    if weights == "imagenet":
        key = "top" if include_top else "notop"
        entry = files.get(key)
        if entry is None:
            raise TapehookError(
                f"larq-zoo released no ImageNet weights for {name} with "
                f"include_top={include_top}; train it (examples/train_zoo.py) or pass a "
                "weights file of your own as weights=..."
            )
        weights = download(entry)
    if weights is not None:
        load_weights(model, weights)
    return model


def load_weights(model, path):
    """Loads a larq-zoo (tf-keras, Keras 2 HDF5) weights file into ``model``
    by layer order, as larq-zoo's ``model.load_weights(path)`` does."""
    try:
        model.load_weights(os.fspath(path))
    except (ValueError, KeyError, OSError) as e:
        raise TapehookError(
            f"{path} does not fit {model.name}: {e}. Pass the larq-zoo weights file of "
            "this same model and include_top setting (top and no-top files differ)"
        ) from e
