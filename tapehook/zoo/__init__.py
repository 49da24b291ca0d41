"""tapehook.zoo: larq-zoo 2.4's models on Keras 3, running on tapehook.

Each model function takes larq-zoo's arguments,
``Name(*, input_shape=None, input_tensor=None, weights=None, include_top=True,
num_classes=1000)``, and returns a functional Keras 3 model with larq-zoo's
architecture, whose binary layers are ``tapehook.larq`` layers.
``weights`` is None (random initialization), the path of a larq-zoo weights
file (Keras 2 HDF5, as larq-zoo releases them and tf-keras's
``save_weights`` writes them), or ``"imagenet"``: larq-zoo's release file,
downloaded once into Keras's cache and checked against its SHA-256.

Beyond larq-zoo: ``ReActNetA`` (ReActNet-A, Liu et al. 2020), the same
arguments, with no ``"imagenet"`` weights (``EXTRA_MODELS``).
"""

from tapehook.zoo.classic import BinaryAlexNet, DoReFaNet, XNORNet
from tapehook.zoo.densenets import (
    BinaryDenseNet28,
    BinaryDenseNet37,
    BinaryDenseNet37Dilated,
    BinaryDenseNet45,
    MeliusNet22,
)
from tapehook.zoo.preprocessing import decode_predictions, preprocess_input
from tapehook.zoo.quicknet import QuickNet, QuickNetLarge, QuickNetSmall
from tapehook.zoo.reactnet import ReActNetA
from tapehook.zoo.resnets import BinaryResNetE18, BiRealNet, RealToBinaryNet

__all__ = [
    "QuickNetSmall",
    "QuickNet",
    "QuickNetLarge",
    "BiRealNet",
    "RealToBinaryNet",
    "BinaryResNetE18",
    "BinaryDenseNet28",
    "BinaryDenseNet37",
    "BinaryDenseNet37Dilated",
    "BinaryDenseNet45",
    "MeliusNet22",
    "XNORNet",
    "DoReFaNet",
    "BinaryAlexNet",
    "ReActNetA",
    "decode_predictions",
    "preprocess_input",
]

MODELS = tuple(__all__[:14])
"""larq-zoo's model functions' names, in larq-zoo's order."""

EXTRA_MODELS = ("ReActNetA",)
"""The model functions larq-zoo does not have (no ImageNet weights)."""
