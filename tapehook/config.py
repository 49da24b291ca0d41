"""tapehook.config: the settings that choose how binary convs run.

One object, ``tapehook.config``, holds them:

    with tapehook.config(dispatch="stock", backprop_dy="bf16x2"):
        ...                                  # this thread only, until the block ends
    tapehook.config.set(pack_inputs="float32")  # every thread, until changed
    tapehook.config.get("dispatch")             # the value in force here
    tapehook.config.current()                   # {name: value} for every setting

The value in force is, first found: the innermost ``with config(...)`` of the
calling thread, then ``config.set``, then the setting's environment variable
(``SETTINGS[name].env``), then its default. Every value is checked against
the allowed ones; a bad one, passed or from the environment, is a
TapehookError that names them.

Settings are read where the choice is made, as the environment variables
were: at trace time in graphs (a tf.function, a Keras train step), per call
in eager. A function traced inside ``with config(...)`` keeps that choice
for as long as TF reuses its trace; to change it, trace again (a new
tf.function, or ``model.compile`` again for Keras). The settings reach the
kernels as op attrs (the plan, backprop_dy), never through the environment.

A ``with`` block's settings are the calling thread's: threads it starts, such
as a multi-replica tf.distribute strategy's, see ``config.set``'s values.
"""

import dataclasses
import os
import threading

from tapehook.errors import TapehookError


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting: its environment variable (the default when Python sets
    nothing), built-in default, allowed values and what it chooses."""

    env: str
    default: str
    allowed: tuple
    doc: str


SETTINGS = {
    "dispatch": Setting(
        "TAPEHOOK_DISPATCH",
        "auto",
        ("auto", "kernels", "stock"),
        "which implementation runs each binary conv: tapehook's kernels where "
        "they beat stock TF ('auto'), always ('kernels'; on a GPU, the CUDA "
        "kernels' opt-in) or never ('stock'); tapehook/dispatch.py",
    ),
    "backprop_dy": Setting(
        "TAPEHOOK_BACKPROP_DY",
        "exact",
        ("exact", "bf16x2"),
        "how the AMX backprops split dy into bf16 parts: three, every product "
        "exact ('exact'), or two, dy to 16 significant bits and two thirds of "
        "the work ('bf16x2'); other kernels are exact fp32 and ignore it",
    ),
    "pack_inputs": Setting(
        "TAPEHOOK_PACK_INPUTS",
        "1",
        ("1", "0", "float16", "float32"),
        "what a binary-activation conv's backward keeps of its input: bits "
        "and a 16-bit fixed-point e'(x) ('1'), bits and a binary16 e'(x) "
        "('float16'), bits for ste_sign only ('float32') or x ('0'); "
        "tapehook/packing.py",
    ),
    "kernels": Setting(
        "TAPEHOOK_KERNELS",
        "auto",
        ("auto", "reference", "compiled"),
        "the backend: the compiled kernels where they load ('auto'), the "
        "reference path of plain TF ops ('reference'), or the kernels with a "
        "failure to load them an error ('compiled'). The environment variable "
        "also decides whether `import tapehook` builds them",
    ),
    "fast_layers": Setting(
        "TAPEHOOK_FAST_LAYERS",
        "1",
        ("1", "0"),
        "whether Keras's BatchNormalization, MaxPooling2D, Add and Adam in a "
        "model tapehook is in charge of run tapehook's implementations ('1') "
        "or stay Keras's ('0'); read when such a layer is first called; "
        "tapehook/models.py",
    ),
}


def _setting(name) -> Setting:
    if name not in SETTINGS:
        raise TapehookError(
            f"tapehook.config has no setting {name!r}; the settings are {tuple(SETTINGS)}"
        )
    return SETTINGS[name]


def _canonical(name, value):
    """``value`` checked for setting ``name``; True / False / 1 / 0 stand for
    pack_inputs' and fast_layers' '1' / '0'."""
    setting = _setting(name)
    if (
        name in ("pack_inputs", "fast_layers")
        and isinstance(value, (bool, int))
        and value in (0, 1)
    ):
        value = str(int(value))
    if value not in setting.allowed:
        raise TapehookError(
            f"tapehook.config {name}={value!r}; use one of {setting.allowed} "
            f"(default {setting.default!r}, or ${setting.env})"
        )
    return value


def _from_environment(name):
    setting = SETTINGS[name]
    value = os.environ.get(setting.env)
    if value is None:
        return setting.default
    if value not in setting.allowed:
        raise TapehookError(
            f"{setting.env}={value!r}; use one of {setting.allowed} (unset is "
            f"{setting.default!r}; tapehook.config.set({name}=...) overrides it)"
        )
    return value


class _Scope:
    """``with config(...)``: the settings for this thread until the block ends."""

    def __init__(self, owner, settings):
        self._owner = owner
        self._settings = settings

    def __enter__(self):
        self._owner._stack().append(self._settings)
        return self._owner

    def __exit__(self, *exc):
        stack = self._owner._stack()
        if not stack or stack[-1] is not self._settings:
            raise TapehookError(
                "tapehook.config blocks closed out of order; leave the innermost first"
            )
        stack.pop()
        return False


class Config:
    """The settings in force (module docstring). ``SETTINGS`` names them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._process = {}
        self._local = threading.local()

    def _stack(self):
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def __call__(self, **settings):
        """A context manager: ``settings`` in force in this thread inside it."""
        return _Scope(self, {name: _canonical(name, v) for name, v in settings.items()})

    def set(self, **settings):
        """Sets ``settings`` for every thread (``None``: back to the
        environment variable or default). A ``with`` block still overrides."""
        checked = {name: None if v is None else _canonical(name, v) for name, v in settings.items()}
        with self._lock:
            for name, value in checked.items():
                if value is None:
                    self._process.pop(name, None)
                else:
                    self._process[name] = value

    def get(self, name):
        """The value of setting ``name`` in force in this thread."""
        _setting(name)
        for scope in reversed(self._stack()):
            if name in scope:
                return scope[name]
        with self._lock:
            if name in self._process:
                return self._process[name]
        return _from_environment(name)

    def current(self) -> dict:
        """{name: value} of every setting in force in this thread."""
        return {name: self.get(name) for name in SETTINGS}

    def __repr__(self):
        body = ", ".join(f"{name}={value!r}" for name, value in self.current().items())
        return f"tapehook.config({body})"


config = Config()
