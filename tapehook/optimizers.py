"""Keras 3 optimizers for binary weights: Bop, and CaseOptimizer to combine it
with a float optimizer.

Which variables are binary is read from tapehook's marks (a variable is
binary when ``binary_spec_of(var)`` is a spec whose weights are binarized),
so no name predicates are needed. Marks made lazily (layers of a binarized
model are marked when first called) are in place before Keras builds the
optimizer, because Keras builds it after the model's first (symbolic) call.
"""

import contextlib
import math
import threading
import warnings

import keras
import tensorflow as tf
from keras.optimizers.schedules import LearningRateSchedule

from tapehook import kernels, marks
from tapehook.compat import control_flow_util, ops
from tapehook.constraints import WeightClip
from tapehook.errors import TapehookError

_PACKAGE = "tapehook"


def is_binary_variable(var) -> bool:
    """True for variables whose weights tapehook binarizes (marked, weights=True)."""
    spec = marks.binary_spec_of(var)
    return spec is not None and bool(getattr(spec, "weights", True))


def _name(var) -> str:
    return getattr(var, "path", None) or getattr(var, "name", repr(var))


def _hyper(value, name, low, high, low_open, fix):
    """A float hyperparameter in its range, or a schedule (checked when used)."""
    if callable(value):  # a LearningRateSchedule or a function of the step
        return value
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (
            math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
        )
    ):
        raise TapehookError(f"Bop({name}={value!r}): {fix}")
    return float(value)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class Bop(keras.optimizers.Optimizer):
    """Bop, the binary optimizer (Helwegen et al., 2019, "Latent weights do not
    exist: rethinking binarized neural network optimization").

    Bop keeps no latent weights: each binary weight w in {-1, +1} keeps an
    exponential moving average m of its gradient and flips when m is strong
    enough and points the way w does (the loss falls by moving w against its
    gradient):

        m <- m + gamma (g - m)                   # = (1 - gamma) m + gamma g
        w <- -sign(w)   where  w m > threshold   # flip
             sign(w)    elsewhere               # sign(0) = +1

    The same rule as larq 0.14's Bop, including on its first step: weights
    that are not +-1 yet (a float initialization) become sign(w), or -sign(w)
    where w m > threshold, so after one step every weight is +-1.

    Args:
        threshold: how strong the averaged gradient must be to flip a weight
            (>= 0), or a ``keras.optimizers.schedules.LearningRateSchedule``.
        gamma: the adaptivity rate in (0, 1], Bop's analogue of a learning rate,
            or a schedule. It is this optimizer's ``learning_rate``, so Keras
            learning-rate callbacks and schedules act on gamma.
        name: the optimizer's name.
        **kwargs: the usual Keras optimizer arguments (clipnorm, clipvalue,
            global_clipnorm, gradient_accumulation_steps, loss_scale_factor).
            ``weight_decay`` and ``use_ema`` are refused: either would make the
            weights non-binary.

    Bop trains binary variables only; give it to ``CaseOptimizer`` to train
    the float rest of a model with another optimizer.
    """

    def __init__(self, threshold=1e-8, gamma=1e-4, name="Bop", **kwargs):
        for key, why in (
            ("learning_rate", "Bop's step size is gamma"),
            ("weight_decay", "decay would make binary weights non-binary"),
            ("use_ema", "averaged weights are not binary"),
        ):
            if kwargs.get(key) not in (None, False):
                raise TapehookError(
                    f"Bop does not take {key}={kwargs[key]!r}: {why}; set it on the "
                    f"float optimizer of a tapehook.optimizers.CaseOptimizer instead"
                )
            kwargs.pop(key, None)
        gamma = _hyper(
            gamma,
            "gamma",
            0.0,
            1.0,
            True,
            "gamma is the momentum's adaptivity rate and must be in (0, 1], "
            "e.g. 1e-4 (or a LearningRateSchedule)",
        )
        threshold = _hyper(
            threshold,
            "threshold",
            0.0,
            math.inf,
            False,
            "threshold must be a finite number >= 0, e.g. 1e-8 (or a LearningRateSchedule)",
        )
        super().__init__(learning_rate=gamma, name=name, **kwargs)
        if isinstance(threshold, float):
            # A variable like Keras's learning_rate: settable, checkpointed.
            with keras.name_scope(self.name, caller=self):
                threshold = keras.Variable(
                    threshold,
                    name="threshold",
                    dtype="float32",
                    trainable=False,
                    aggregation="only_first_replica",
                )
            self._track_variable(threshold)
        self._threshold = threshold

    @property
    def gamma(self):
        return self.learning_rate

    @gamma.setter
    def gamma(self, value):
        self.learning_rate = value

    @property
    def threshold(self):
        if isinstance(self._threshold, keras.Variable):
            return self._threshold
        if isinstance(self._threshold, LearningRateSchedule):
            return self._threshold(self._iterations)
        return self._threshold()

    @threshold.setter
    def threshold(self, value):
        if not isinstance(self._threshold, keras.Variable):
            raise TapehookError(
                "this Bop was created with a threshold schedule; create a new Bop "
                "with a float threshold to set it"
            )
        self._threshold.assign(
            _hyper(
                value, "threshold", 0.0, math.inf, False, "threshold must be a finite number >= 0"
            )
        )

    def build(self, variables):
        if self.built:
            return
        for var in variables:
            if not is_binary_variable(var):
                spec = marks.binary_spec_of(var)
                why = (
                    "is not marked binary"
                    if spec is None
                    else "is marked with weights=False (its weights stay float)"
                )
                raise TapehookError(
                    f"Bop trains binary weights only, but variable {_name(var)!r} {why}; "
                    f"use tapehook.optimizers.CaseOptimizer(Bop(...), "
                    f"keras.optimizers.Adam()) so that float variables get a float "
                    f"optimizer (or mark the variable binary before training)"
                )
        super().build(variables)
        self._momentums = self.add_optimizer_variables(variables, "momentum")

    def update_step(self, gradient, variable, learning_rate):
        dtype = variable.dtype
        gamma = tf.cast(learning_rate, dtype)
        threshold = tf.cast(self.threshold, dtype)
        gradient = tf.cast(tf.convert_to_tensor(gradient), dtype)
        m = self._momentums[self._get_variable_index(variable)]
        # m + gamma (g - m), larq's rounding of (1 - gamma) m + gamma g.
        m_new = m + gamma * (gradient - m)
        self.assign(m, m_new)
        w = tf.convert_to_tensor(variable)
        agreement = w * m_new
        # Flip where w m > threshold, keep where below; w m == threshold gives
        # +1, as larq's sign(-sign(w m - threshold) w) does.
        flipped = tf.where(
            agreement > threshold, -w, tf.where(agreement < threshold, w, tf.zeros_like(w))
        )
        self.assign(variable, tf.where(flipped >= 0, tf.ones_like(w), -tf.ones_like(w)))

    def get_config(self):
        config = super().get_config()
        config["gamma"] = config.pop("learning_rate")
        for key in ("weight_decay", "use_ema", "ema_momentum", "ema_overwrite_frequency"):
            config.pop(key)
        threshold = self._threshold
        config["threshold"] = (
            float(threshold.numpy())
            if isinstance(threshold, keras.Variable)
            else keras.saving.serialize_keras_object(threshold)
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        for key in ("gamma", "threshold"):
            if isinstance(config.get(key), dict):
                config[key] = keras.saving.deserialize_keras_object(
                    config[key], custom_objects=custom_objects
                )
        return cls(**config)


def _check_sub_optimizer(optimizer, what):
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TapehookError(
            f"CaseOptimizer's {what} must be a Keras 3 optimizer "
            f"(keras.optimizers.Optimizer), got {type(optimizer).__name__}; legacy "
            f"tf.keras / larq optimizers do not train Keras 3 models"
        )
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or (
        optimizer.loss_scale_factor is not None
    ):
        raise TapehookError(
            f"CaseOptimizer's {what} scales the loss itself; the loss is scaled once, "
            f"for all variables: wrap the CaseOptimizer instead, "
            f"keras.optimizers.LossScaleOptimizer(CaseOptimizer(...)) (Keras does that "
            f"itself under the mixed_float16 policy)"
        )
    if isinstance(optimizer, CaseOptimizer):
        raise TapehookError(
            f"CaseOptimizer's {what} cannot be another CaseOptimizer; "
            f"pass all (predicate, optimizer) pairs to one"
        )


@keras.saving.register_keras_serializable(package=_PACKAGE)
class CaseOptimizer(keras.optimizers.Optimizer):
    """Trains binary variables with one optimizer and all others with another.

    ``CaseOptimizer(binary, default)``: variables whose weights tapehook
    binarizes (marked, with ``weights=True``) are trained by ``binary`` (e.g.
    ``Bop()``); all others (float layers, BatchNorm, ``weights=False``
    kernels) by ``default`` (e.g. ``keras.optimizers.Adam()``). larq's form is
    accepted too: ``CaseOptimizer((predicate, optimizer), ...,
    default_optimizer=...)``, where a predicate takes a variable and at most
    one may claim each variable.

    Routing is decided once, when the optimizer is built (by Keras before the
    first training step, or by the first ``apply_gradients``): mark or
    binarize the model before training starts. A variable whose mark changes
    afterwards makes the next traced step raise TapehookError (create a new
    optimizer then). Each optimizer keeps its own state and step count
    (``iterations`` of the CaseOptimizer counts its own steps);
    ``learning_rate`` is the default optimizer's, so Keras learning-rate
    callbacks act on it. Under ``mixed_float16`` Keras wraps the
    CaseOptimizer in a LossScaleOptimizer, which is the supported order.
    """

    def __init__(self, *optimizers, default_optimizer=None, name="case_optimizer", **kwargs):
        if kwargs:
            raise TapehookError(
                f"CaseOptimizer does not take {sorted(kwargs)}: set clipping, weight "
                f"decay, EMA and loss scaling on the optimizers it combines"
            )
        pairs, default, marks_form = self._parse(optimizers, default_optimizer)
        super().__init__(learning_rate=0.0, name=name)
        # Attributes, so that tf.train.Checkpoint and .keras saving track them.
        for index, (_, optimizer) in enumerate(pairs):
            setattr(self, f"optimizer_{index}", optimizer)
        self.default_optimizer = default
        object.__setattr__(self, "_pairs", list(pairs))
        object.__setattr__(self, "_marks_form", marks_form)
        object.__setattr__(self, "_routing", None)  # index per variable key
        object.__setattr__(self, "_routing_by_path", None)  # from a saved config

    @staticmethod
    def _parse(optimizers, default_optimizer):
        """(pairs, default, whether routing follows tapehook's marks)."""
        marks_form = (
            len(optimizers) == 2
            and default_optimizer is None
            and not any(isinstance(o, tuple) for o in optimizers)
        )
        if marks_form:
            pairs, default_optimizer = [(is_binary_variable, optimizers[0])], optimizers[1]
            names = ["binary optimizer", "default optimizer"]
        elif optimizers and all(
            isinstance(p, tuple) and len(p) == 2 and callable(p[0]) for p in optimizers
        ):
            pairs = list(optimizers)
            names = [f"optimizer of pair {i}" for i in range(len(pairs))] + ["default_optimizer"]
        else:
            raise TapehookError(
                "CaseOptimizer takes (binary_optimizer, default_optimizer), e.g. "
                "CaseOptimizer(tapehook.optimizers.Bop(), keras.optimizers.Adam()), or "
                "larq's form: (predicate, optimizer) pairs and default_optimizer=..."
            )
        subs = [o for _, o in pairs] + [default_optimizer]
        for optimizer, what in zip(subs, names):
            if optimizer is not None or marks_form:
                _check_sub_optimizer(optimizer, what)
        if len({id(o) for o in subs}) != len(subs):
            raise TapehookError("CaseOptimizer needs a distinct optimizer object per case")
        return pairs, default_optimizer, marks_form

    # ---- the optimizers it combines ----

    @property
    def optimizers(self):
        """The combined optimizers, the default one last (if any)."""
        subs = [optimizer for _, optimizer in self._pairs]
        return subs + ([self.default_optimizer] if self.default_optimizer is not None else [])

    @property
    def binary(self):
        return self._pairs[0][1]

    @property
    def default(self):
        return self.default_optimizer

    @property
    def variables(self):
        variables = self._variables[:]
        for optimizer in self.optimizers:
            variables.extend(optimizer.variables)
        return variables

    def _learning_rate_owner(self):
        if self.default_optimizer is None:
            raise TapehookError(
                "this CaseOptimizer has no default optimizer, hence no "
                "learning rate; set it on the optimizers it combines"
            )
        return self.default_optimizer

    @property
    def learning_rate(self):
        return self._learning_rate_owner().learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        self._learning_rate_owner().learning_rate = value

    # ---- routing ----

    def _route(self, var):
        """Index in ``optimizers`` of the optimizer that trains ``var``, or None."""
        if self._routing_by_path is not None:
            if _name(var) not in self._routing_by_path:
                raise TapehookError(
                    f"variable {_name(var)!r} is not in the routing this CaseOptimizer was "
                    f"saved with (predicates are not saved, each variable's optimizer is); "
                    f"build it for the model it was saved with, or create a new one"
                )
            return self._routing_by_path[_name(var)]
        claims = [i for i, (predicate, _) in enumerate(self._pairs) if predicate(var)]
        if len(claims) > 1:
            raise TapehookError(
                f"variable {_name(var)!r} is claimed by the predicates of pairs {claims}; "
                f"make the predicates exclusive"
            )
        if claims:
            return claims[0]
        return len(self._pairs) if self.default_optimizer is not None else None

    def build(self, variables):
        if self.built:
            return
        variables = list(variables)
        routing = {}
        groups = [[] for _ in self.optimizers]
        for var in variables:
            index = self._route(var)
            routing[self._var_key(var)] = index
            if index is not None:
                groups[index].append(var)
        for index, (_, optimizer) in enumerate(self._pairs):
            if not groups[index] and self._routing_by_path is None:
                what = (
                    "no variable is marked binary"
                    if self._marks_form
                    else f"the predicate of pair {index} claims no variable"
                )
                raise TapehookError(
                    f"CaseOptimizer: {what}, so {optimizer.name} would train nothing; "
                    f"binarize or mark the model before its first training step "
                    f"(routing is decided when the optimizer is built)"
                )
        untrained = [_name(v) for v in variables if routing[self._var_key(v)] is None]
        if untrained:
            warnings.warn(
                f"CaseOptimizer: no predicate claims {untrained} and there is no "
                f"default_optimizer, so they are not trained",
                stacklevel=2,
            )
        object.__setattr__(self, "_routing", routing)
        object.__setattr__(self, "_paths", {self._var_key(v): _name(v) for v in variables})
        for optimizer, group in zip(self.optimizers, groups):
            optimizer.build(group)
        super().build(variables)

    def _check_routing(self, variables):
        """Routing is decided at build: refuse variables it has not seen, and
        (marks form) variables whose mark changed since, which would be
        trained by the wrong optimizer."""
        for var in variables:
            key = self._var_key(var)
            if key not in self._routing:
                raise TapehookError(
                    f"variable {_name(var)!r} was not among the variables this "
                    f"CaseOptimizer was built with; create a new optimizer for a new "
                    f"set of variables"
                )
            if (
                self._marks_form
                and self._routing_by_path is None
                and self._routing[key] != self._route(var)
            ):
                now = "binary" if is_binary_variable(var) else "float"
                raise TapehookError(
                    f"variable {_name(var)!r} became {now} after the CaseOptimizer was "
                    f"built (routing is decided at build); mark or unmark variables "
                    f"before training starts, or compile with a new CaseOptimizer"
                )

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is None:
            if not self.built:
                raise TapehookError(
                    "CaseOptimizer.apply without variables needs a built "
                    "optimizer; call build(variables) first"
                )
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        grads = list(grads)
        if not grads:
            return
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        self._check_routing(trainable_variables)
        groups = [([], []) for _ in self.optimizers]
        for grad, var in zip(grads, trainable_variables):
            index = self._routing.get(self._var_key(var))
            if grad is not None and index is not None:
                groups[index][0].append(grad)
                groups[index][1].append(var)
        if not any(g for g, _ in groups):
            raise ValueError("No gradients provided for any variable.")
        for optimizer, (group_grads, group_vars) in zip(self.optimizers, groups):
            if group_grads:
                optimizer.apply(group_grads, group_vars)
        self._iterations.assign_add(1)

    def finalize_variable_values(self, var_list):
        var_list = list(var_list)
        for index, optimizer in enumerate(self.optimizers):
            optimizer.finalize_variable_values(
                [
                    v
                    for v in var_list
                    if self._routing and self._routing.get(self._var_key(v)) == index
                ]
            )

    # ---- serialization ----

    def get_config(self):
        config = {"name": self.name}
        serialize = keras.saving.serialize_keras_object
        if self._marks_form:
            config["binary"] = serialize(self.binary)
            config["default"] = serialize(self.default_optimizer)
            return config
        if self._routing_by_path is not None:
            routing = self._routing_by_path
        elif self._routing is not None:
            routing = {}
            for key, index in self._routing.items():
                if routing.setdefault(self._paths[key], index) != index:
                    raise TapehookError(
                        f"two variables named {self._paths[key]!r} go to different "
                        f"optimizers, so the routing cannot be saved by name; give the "
                        f"variables distinct names"
                    )
        else:
            raise TapehookError(
                "a CaseOptimizer with custom predicates can only be serialized once "
                "built (predicates are not serializable; the routing of each variable "
                "is saved instead); train a step or call build(variables) first"
            )
        config["optimizers"] = [serialize(o) for _, o in self._pairs]
        config["default_optimizer"] = (
            serialize(self.default_optimizer) if self.default_optimizer is not None else None
        )
        config["routing"] = routing
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        def load(value):
            return (
                keras.saving.deserialize_keras_object(value, custom_objects=custom_objects)
                if value is not None
                else None
            )

        if "binary" in config:
            return cls(load(config["binary"]), load(config["default"]), name=config["name"])
        pairs = [(lambda _: False, load(o)) for o in config["optimizers"]]
        optimizer = cls(
            *pairs, default_optimizer=load(config["default_optimizer"]), name=config["name"]
        )
        object.__setattr__(optimizer, "_routing_by_path", dict(config["routing"]))
        return optimizer


@keras.saving.register_keras_serializable(package=_PACKAGE)
class Adam(keras.optimizers.Adam):
    """``keras.optimizers.Adam`` whose update is TensorFlow's fused
    ``ResourceApplyAdam``: one op and one pass over a variable, its gradient
    and both moments per step, where Keras 3 runs about a dozen elementwise
    ops (each a pass over the variable). tf-keras's Adam, and so larq's
    training, used the fused op.

    The same arguments and math as Keras 3's Adam (TF's kernel computes
    ``alpha = lr sqrt(1 - b2^t) / (1 - b1^t)``, ``m += (g - m)(1 - b1)``,
    ``v += (g^2 - v)(1 - b2)``, ``var -= alpha m / (sqrt(v) + epsilon)``, as
    Keras's does), to float rounding. ``amsgrad=True`` and sparse gradients
    (``IndexedSlices``) run Keras's own update. Weight decay, gradient
    clipping, EMA and loss scaling are the base optimizer's, as in Keras.

    A float32 variable whose constraint is a ``WeightClip`` (tapehook's or
    ``tapehook.larq``'s: the latent weights of a binary layer) is updated
    and clipped by one compiled kernel, ``TapehookResourceApplyAdamClip``:
    one pass instead of the update and then Keras's constraint (two more
    passes and a copy). Its result is bit for bit ResourceApplyAdam's
    followed by ``tf.clip_by_value`` (NaN stays NaN). It runs where the
    compiled kernels are loaded and no GPU is visible (it is a CPU kernel),
    outside XLA-compiled steps (``jit_compile=True``: no XLA kernel), for
    dense gradients, without EMA and without gradient accumulation
    (whose EMA and skipped steps Keras orders around the constraint); the
    others take the separate update and constraint.
    """

    def _fused_variables(self, grads, variables):
        """The variables whose update and WeightClip run as one kernel in
        this apply: the one place that decides. apply suspends their
        constraint for the call (Keras then skips it); update_step runs the
        kernel for exactly the variables whose constraint is suspended."""
        if self.amsgrad or self.use_ema or self.gradient_accumulation_steps:
            return []
        if kernels.cpu_library() is None or control_flow_util.GraphOrParentsInXlaContext(
            ops.get_default_graph()
        ):
            return []  # no kernels, a GPU, or jit_compile=True (no XLA kernel)
        fused = []
        for grad, var in zip(grads, variables):
            suspended = _suspended_constraint(var)  # by another replica's apply
            constraint = var.constraint if suspended is None else suspended
            if (
                isinstance(constraint, WeightClip)
                and type(constraint).__call__ is WeightClip.__call__
                and grad is not None
                and not isinstance(grad, tf.IndexedSlices)
                and var.dtype == "float32"
                and not getattr(var, "overwrite_with_gradient", False)
            ):
                fused.append(var)
        return fused

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        variables = (
            trainable_variables
            if trainable_variables is not None
            else getattr(self, "_trainable_variables", [])
        )
        with _constraints_applied_in_update(self._fused_variables(grads, variables)):
            return super().apply(grads, trainable_variables)

    def update_step(self, gradient, variable, learning_rate):
        if self.amsgrad or isinstance(gradient, tf.IndexedSlices):
            return super().update_step(gradient, variable, learning_rate)
        index = self._get_variable_index(variable)
        dtype = variable.dtype
        step = tf.cast(self.iterations + 1, dtype)

        def raw(v):  # a Keras variable's tf.Variable (a replica's, in update())
            return v.value if isinstance(v, keras.Variable) else v

        inputs = dict(
            var=raw(variable).handle,
            m=raw(self._momentums[index]).handle,
            v=raw(self._velocities[index]).handle,
            beta1_power=tf.pow(tf.cast(self.beta_1, dtype), step),
            beta2_power=tf.pow(tf.cast(self.beta_2, dtype), step),
            lr=tf.cast(learning_rate, dtype),
            beta1=tf.cast(self.beta_1, dtype),
            beta2=tf.cast(self.beta_2, dtype),
            epsilon=tf.cast(self.epsilon, dtype),
            grad=tf.cast(gradient, dtype),
        )
        # Fused exactly where apply suspended the constraint (its decision).
        clip = _suspended_constraint(self._trainable_variables[index])
        if clip is None:
            tf.raw_ops.ResourceApplyAdam(**inputs)
        else:
            kernels.library().tapehook_resource_apply_adam_clip(**inputs, clip=clip.clip_value)


# Keras's Optimizer.apply assigns each variable's constraint after the update;
# for the variables whose update already clipped (Adam._fused_variables) it reads
# None meanwhile. Replicas under MirroredStrategy run apply on threads at the
# same time, so entries count: the last one out puts the constraint back.
_suspended_lock = threading.Lock()
_suspended = {}  # id(variable) -> [constraint, depth]


def _suspended_constraint(var):
    """var's constraint while an apply has it suspended, else None."""
    with _suspended_lock:
        entry = _suspended.get(id(var))
    return entry[0] if entry is not None else None


@contextlib.contextmanager
def _constraints_applied_in_update(variables):
    with _suspended_lock:
        for var in variables:
            entry = _suspended.setdefault(id(var), [var.constraint, 0])
            entry[1] += 1
            var.constraint = None
    try:
        yield
    finally:
        with _suspended_lock:
            for var in variables:
                entry = _suspended[id(var)]
                entry[1] -= 1
                if entry[1] == 0:
                    var.constraint = entry[0]
                    del _suspended[id(var)]
