"""larq.utils on Keras 3."""

import importlib
from contextlib import contextmanager

import keras


def memory_as_readable_str(num_bits: int) -> str:
    """Bits as a human-readable size with binary prefixes (1 KiB = 1024 B)."""
    num_bytes = num_bits / 8
    for i, suffix in enumerate(["B", "KiB", "MiB", "GiB"]):
        rounded = num_bytes / (1024**i)
        if rounded < 1024:
            break
    return f"{rounded:,.2f} {suffix}"


def register_keras_custom_object(cls):
    """Registers ``cls`` under its own name, as larq does (for string lookup)."""
    keras.saving.get_custom_objects()[cls.__name__] = cls
    return cls


def register_alias(name: str):
    """Registers a custom object under an alias (e.g. ``"ste_sign"``)."""

    def register(cls):
        keras.saving.get_custom_objects()[name] = cls
        return cls

    return register


def register_keras_name(kind: str, name: str, obj):
    """Makes ``keras.<kind>.get(name)`` return ``obj`` (``kind``: "activations",
    "constraints").

    Keras 3's ``get(str)`` looks a name up only in its own table of built-ins
    (``keras.src.<kind>.ALL_OBJECTS_DICT``), never in the custom-object registry
    that tf-keras consulted, so larq's string names need an entry there. A name
    Keras already has keeps Keras's object. A Keras without that table leaves
    ``get(name)`` unresolved (layers still resolve larq's names themselves).
    """
    try:
        table = importlib.import_module(f"keras.src.{kind}").ALL_OBJECTS_DICT
    except (ImportError, AttributeError):
        return
    table.setdefault(name, obj)


def set_precision(precision: int = 32):
    """Sets ``function.precision`` (read by summary and Bop.is_binary_variable)."""

    def decorator(function):
        function.precision = precision
        return function

    return decorator


@contextmanager
def patch_object(obj, name, value):
    """Temporarily overwrites ``obj.name``."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)
