"""larq.optimizers on Keras 3: Bop and CaseOptimizer (tapehook.optimizers).

``Bop.is_binary_variable`` claims kernels that tapehook marks binary and,
as larq's does, any variable whose quantizer has ``precision == 1`` (a larq
layer's kernel quantized with plain ops, or tagged with ``NoOp(precision=1)``).
"""

import keras

from tapehook.errors import TapehookError

__all__ = ["Bop", "CaseOptimizer"]

try:
    from tapehook import optimizers as _th
except ImportError as exc:  # tapehook without its optimizers module
    _th = None
    _MISSING = exc


def _require():
    if _th is None:
        raise TapehookError(
            f"tapehook.larq.optimizers needs tapehook.optimizers (Bop, CaseOptimizer), "
            f"which this tapehook does not have ({_MISSING}); upgrade tapehook"
        )


def _is_binary_variable(var):
    if getattr(var, "precision", None) == 1:
        return True
    return _th is not None and _th.is_binary_variable(var)


if _th is not None:

    @keras.saving.register_keras_serializable(package="larq")
    class Bop(_th.Bop):
        """Bop (Helwegen et al., 2019) with larq's signature:
        ``Bop(threshold=1e-8, gamma=1e-4, name="Bop", **kwargs)``."""

        @staticmethod
        def is_binary_variable(var):
            """True for binary kernels (tapehook marks or larq precision 1)."""
            return _is_binary_variable(var)

        def build(self, variables):
            if self.built:
                return
            for var in variables:
                if not _is_binary_variable(var):
                    raise TapehookError(
                        f"Bop trains binary weights only, but variable "
                        f"{getattr(var, 'path', var.name)!r} is not binary; use "
                        f"CaseOptimizer((Bop.is_binary_variable, Bop()), "
                        f"default_optimizer=keras.optimizers.Adam())"
                    )
            keras.optimizers.Optimizer.build(self, variables)
            self._momentums = self.add_optimizer_variables(variables, "momentum")

    @keras.saving.register_keras_serializable(package="larq")
    class CaseOptimizer(_th.CaseOptimizer):
        """larq's ``CaseOptimizer(*(predicate, optimizer), default_optimizer=None)``.

        Each variable goes to the optimizer of the one predicate that claims
        it, else to ``default_optimizer``. A predicate that is not callable or
        an optimizer that is not a Keras 3 optimizer raise TypeError (as in
        larq); two predicates claiming one variable, or a variable no
        predicate claims without a default, raise ValueError when built.
        """

        def __init__(
            self,
            *predicate_optimizer_pairs,
            default_optimizer=None,
            name="optimizer_case_operator",
            **kwargs,
        ):
            for pair in predicate_optimizer_pairs:
                if not isinstance(pair, tuple) or len(pair) != 2:
                    raise TypeError(
                        f"CaseOptimizer takes (predicate, optimizer) pairs, got {pair!r}"
                    )
                predicate, optimizer = pair
                if not callable(predicate):
                    raise TypeError(f"Expected a callable predicate, got {predicate!r}")
                if not isinstance(optimizer, keras.optimizers.Optimizer):
                    raise TypeError(f"Expected a Keras 3 optimizer, got {optimizer!r}")
            if default_optimizer is not None and not isinstance(
                default_optimizer, keras.optimizers.Optimizer
            ):
                raise TypeError(
                    f"Expected a Keras 3 optimizer as default_optimizer, got {default_optimizer!r}"
                )
            super().__init__(
                *predicate_optimizer_pairs, default_optimizer=default_optimizer, name=name, **kwargs
            )

        def build(self, variables):
            if not self.built and self.default_optimizer is None:
                for var in variables:
                    if self._route(var) is None:
                        raise ValueError(
                            f"No `default_optimizer` provided to train variable "
                            f"{getattr(var, 'path', var.name)!r}, which no predicate "
                            f"claims; pass default_optimizer=..."
                        )
            super().build(variables)

        def _named_predicates(self):
            """Pairs whose predicates are all Bop.is_binary_variable serialize by name."""
            return all(p is Bop.is_binary_variable for p, _ in self._pairs)

        def get_config(self):
            if self._routing_by_path is not None or not self._named_predicates():
                return super().get_config()
            serialize = keras.saving.serialize_keras_object
            return {
                "name": self.name,
                "predicate": "Bop.is_binary_variable",
                "optimizers": [serialize(o) for _, o in self._pairs],
                "default_optimizer": (
                    serialize(self.default_optimizer)
                    if self.default_optimizer is not None
                    else None
                ),
            }

        @classmethod
        def from_config(cls, config, custom_objects=None):
            if config.get("predicate") != "Bop.is_binary_variable":
                return super().from_config(config, custom_objects=custom_objects)

            def load(value):
                return (
                    keras.saving.deserialize_keras_object(value, custom_objects=custom_objects)
                    if value is not None
                    else None
                )

            pairs = [(Bop.is_binary_variable, load(o)) for o in config["optimizers"]]
            return cls(
                *pairs, default_optimizer=load(config["default_optimizer"]), name=config["name"]
            )
else:

    class Bop:
        """Unavailable: this tapehook has no tapehook.optimizers."""

        is_binary_variable = staticmethod(_is_binary_variable)

        def __init__(self, *args, **kwargs):
            _require()

    class CaseOptimizer:
        """Unavailable: this tapehook has no tapehook.optimizers."""

        def __init__(self, *args, **kwargs):
            _require()
