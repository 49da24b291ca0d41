"""Knowledge distillation for binary students (ReActNet, Real-to-Binary).

- ``DistributionLoss``: ReActNet's distribution loss, the student's
  cross-entropy against the teacher's softmax, at a temperature.
- ``OutputMatchingLoss``: Real-to-Binary's output matching, the same
  comparison written as KL divergence (same gradient, value lower by the
  teacher's entropy).
- ``AttentionMatchingLoss``: Real-to-Binary's attention matching between
  two feature maps.
- ``Distiller``: a Keras model that trains a student against frozen
  teachers with ``alpha * label loss + beta * distillation loss + gamma *
  attention loss``; ``fit`` / ``evaluate`` / ``predict`` / callbacks /
  tf.distribute work as for any Keras model, and the student is saved alone
  with ``save_student`` or ``StudentCheckpoint``.

The losses compute in their dtype (Keras's floatx, float32 by default;
``dtype="float64"`` for float64), float16 logits and maps cast up, so
mixed_float16 students and teachers can be distilled. Each loss's
docstring has its math; docs/recipes.md shows a Distiller in use.
"""

import keras
import tensorflow as tf

from tapehook.errors import TapehookError

_PACKAGE = "tapehook"
_register = keras.saving.register_keras_serializable(package=_PACKAGE)


def _wide(*tensors):
    dtype = tf.float64 if any(t.dtype == tf.float64 for t in tensors) else tf.float32
    return [tf.cast(t, dtype) for t in tensors]


def soft_cross_entropy(teacher_logits, student_logits, temperature=1.0, kl=False):
    """Per example: T^2 * -sum_i p_i log q_i, p = softmax(teacher / T),
    q = softmax(student / T) over the last axis; ``kl=True`` subtracts the
    teacher's entropy (KL(p || q)), which has the same gradient."""
    teacher, student = _wide(
        tf.convert_to_tensor(teacher_logits), tf.convert_to_tensor(student_logits)
    )
    t = tf.cast(temperature, teacher.dtype)
    log_p = tf.nn.log_softmax(teacher / t, axis=-1)
    log_q = tf.nn.log_softmax(student / t, axis=-1)
    p = tf.stop_gradient(tf.exp(log_p))
    integrand = p * (tf.stop_gradient(log_p) - log_q) if kl else -p * log_q
    return tf.square(t) * tf.reduce_sum(integrand, axis=-1)


@_register
class DistributionLoss(keras.losses.Loss):
    """ReActNet's distribution loss: ``y_true`` is the teacher's logits,
    ``y_pred`` the student's; per example
    T^2 * sum_i -softmax(teacher / T)_i * log softmax(student / T)_i,
    averaged over the batch (Keras's reduction, sample weights). Its gradient
    with respect to the student's logits is
    T * (softmax(student / T) - softmax(teacher / T)) per example: at T = 1,
    ReActNet's loss exactly. The T^2 factor (Hinton et al. 2015) keeps the
    gradient's size roughly independent of T, so the weight beta that mixes it
    with the label loss need not change with T. No gradient reaches the
    teacher's logits.
    """

    _kl = False

    def __init__(self, temperature=1.0, reduction="sum_over_batch_size", name=None, dtype=None):
        if not temperature > 0:
            raise TapehookError(
                f"{type(self).__name__}(temperature={temperature!r}): use a positive number"
            )
        super().__init__(name=name or _snake(type(self).__name__), reduction=reduction, dtype=dtype)
        self.temperature = float(temperature)

    def call(self, y_true, y_pred):
        return soft_cross_entropy(y_true, y_pred, self.temperature, kl=self._kl)

    def get_config(self):
        return {**super().get_config(), "temperature": self.temperature}


@_register
class OutputMatchingLoss(DistributionLoss):
    """Real-to-Binary's output matching (Hinton's distillation as larq-zoo
    trains it): T^2 * KL(softmax(teacher / T) || softmax(student / T)) per
    example, ``y_true`` the teacher's logits. The gradient is
    ``DistributionLoss``'s; the value is lower by T^2 times the teacher's
    entropy, so a perfect student scores 0.
    """

    _kl = True


def attention_map(features):
    """Martinez et al. 2020 / Zagoruyko & Komodakis: Q = sum over channels of
    the squared activations of an NHWC map, flattened per example and divided
    by its L2 norm."""
    (x,) = _wide(tf.convert_to_tensor(features))
    if x.shape.rank != 4:
        raise TapehookError(
            f"attention matching needs NHWC feature maps (rank 4); got shape {x.shape}"
        )
    q = tf.reshape(tf.reduce_sum(tf.square(x), axis=-1), [tf.shape(x)[0], -1])
    return q * tf.math.rsqrt(tf.maximum(tf.reduce_sum(tf.square(q), -1, keepdims=True), 1e-30))


@_register
class AttentionMatchingLoss(keras.losses.Loss):
    """Real-to-Binary's attention matching for one pair of feature maps:
    ``y_true`` the teacher's NHWC map, ``y_pred`` the student's (same H, W;
    channels may differ); per example || Q_S / ||Q_S|| - Q_T / ||Q_T|| ||_2
    (``attention_map``), averaged over the batch. The teacher's map gets no
    gradient. The paper sums this over the matched pairs (``Distiller`` does).

    Zagoruyko's and Real-to-Binary's code average the squared difference
    instead, larq-zoo divides by the maximum: the scales of ``gamma`` differ.
    """

    def __init__(self, reduction="sum_over_batch_size", name="attention_matching_loss", dtype=None):
        super().__init__(name=name, reduction=reduction, dtype=dtype)

    def call(self, y_true, y_pred):
        diff = attention_map(y_pred) - tf.stop_gradient(attention_map(y_true))
        squared = tf.reduce_sum(tf.square(diff), axis=-1)
        # Where the maps agree: 0 with a zero gradient (sqrt's is infinite at 0).
        positive = squared > 0
        return tf.where(positive, tf.sqrt(tf.where(positive, squared, 1)), 0)


def _snake(name):
    return "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(name))


def _pairs(attention):
    """attention: None, or names / (student name, teacher name) pairs."""
    pairs = []
    for item in attention or ():
        if isinstance(item, str):
            pairs.append((item, item))
        elif (
            isinstance(item, (tuple, list))
            and len(item) == 2
            and all(isinstance(n, str) for n in item)
        ):
            pairs.append(tuple(item))
        else:
            raise TapehookError(
                f"Distiller(attention=...): {item!r}; give layer names, or "
                f"(student layer name, teacher layer name) pairs"
            )
    return pairs


def _tapped(model, names, role):
    """model's outputs followed by the outputs of its layers ``names``."""
    if not names:
        return model
    try:
        maps = [model.get_layer(name).output for name in names]
        inputs = model.inputs
    except (ValueError, AttributeError) as error:
        layers = [layer.name for layer in model.layers]
        raise TapehookError(
            f"Distiller(attention=...): cannot tap the {role} {model.name!r} ({error}); "
            f"attention matching needs a functional or Sequential {role} and layer "
            f"names among {layers}"
        ) from None
    return keras.Model(inputs, [*model.outputs, *maps], name=f"{model.name}_attention_taps")


@_register
class Distiller(keras.Model):
    """Trains ``student`` to match frozen ``teacher`` (a model or a list).

    The training loss is
    ``alpha * label loss + beta * distillation loss + gamma * attention loss``
    plus the student's own regularization losses, with

    - label loss: the loss given to ``compile`` on the student's output and
      the labels (skipped when ``fit`` gets no labels);
    - distillation loss: ``distillation_loss(teacher logits, student logits)``,
      default ``DistributionLoss(temperature)``. Several teachers: against
      their mean logits when ``teacher_weights`` is None, else the
      ``teacher_weights``-weighted sum of one loss per teacher;
    - attention loss: the sum over ``attention`` (layer names present in both
      models, or (student layer, teacher layer) pairs) of
      ``AttentionMatchingLoss`` (one teacher only).

    The student's and teachers' outputs are logits. Teachers run in inference
    mode and are frozen (``trainable = False``); only the student trains.
    ``evaluate`` reports the same losses on its data (``loss`` is the total,
    ``label_loss``, ``distillation_loss``, ``attention_loss`` the parts) and
    the compiled metrics on the student's output; ``predict`` and calling the
    Distiller run the student alone. ``save_student`` / ``StudentCheckpoint``
    save the student without the teachers.
    """

    def __init__(
        self,
        student,
        teacher,
        alpha=1.0,
        beta=1.0,
        gamma=0.0,
        temperature=1.0,
        teacher_weights=None,
        attention=None,
        distillation_loss=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        teachers = list(teacher) if isinstance(teacher, (list, tuple)) else [teacher]
        if not teachers or not all(isinstance(t, keras.Model) for t in [student, *teachers]):
            raise TapehookError(
                "Distiller(student, teacher): pass a Keras model as the student and a Keras "
                "model (or a non-empty list of them) as the teacher"
            )
        if teacher_weights is not None:
            teacher_weights = [float(w) for w in teacher_weights]
            if len(teacher_weights) != len(teachers):
                raise TapehookError(
                    f"Distiller: {len(teacher_weights)} teacher_weights for {len(teachers)} "
                    f"teachers; give one weight per teacher, or None to average their logits"
                )
        self.attention = _pairs(attention)
        if self.attention and len(teachers) > 1:
            raise TapehookError(
                "Distiller(attention=...): attention matching takes one teacher; "
                "distill several teachers' outputs without attention, or pass one teacher"
            )
        for t in teachers:
            t.trainable = False
        self.student, self.teachers = student, teachers
        self.alpha, self.beta, self.gamma = float(alpha), float(beta), float(gamma)
        self.temperature, self.teacher_weights = float(temperature), teacher_weights
        self.distillation_loss = (
            keras.losses.get(distillation_loss)
            if distillation_loss is not None
            else DistributionLoss(temperature)
        )
        self.attention_loss = AttentionMatchingLoss()
        self._student_taps = _tapped(student, [s for s, _ in self.attention], "student")
        self._teacher_taps = _tapped(teachers[0], [t for _, t in self.attention], "teacher")
        self.label_loss_tracker = keras.metrics.Mean(name="label_loss")
        # Calling the Distiller calls the student: built when the models are.
        self.built = student.built and all(t.built for t in teachers)
        self.distillation_loss_tracker = keras.metrics.Mean(name="distillation_loss")
        self.attention_loss_tracker = keras.metrics.Mean(name="attention_loss")

    def build(self, input_shape):
        for model in (self.student, *self.teachers):
            if not model.built:
                model.build(input_shape)
        self.built = True

    @property
    def teacher(self):
        """The first (or only) teacher."""
        return self.teachers[0]

    def call(self, inputs, training=None):
        return self.student(inputs, training=training)

    def _student_forward(self, x, training):
        if not self.attention:
            return self.student(x, training=training), []
        outputs = self._student_taps(x, training=training)
        return outputs[0], outputs[1:]

    def _teacher_forward(self, x):
        if self.attention:
            outputs = self._teacher_taps(x, training=False)
            return [tf.stop_gradient(outputs[0])], [tf.stop_gradient(m) for m in outputs[1:]]
        return [tf.stop_gradient(t(x, training=False)) for t in self.teachers], []

    def _loss_parts(self, x, y, y_pred, student_maps, sample_weight):
        """(total, label, distillation, attention), each scaled for tf.distribute
        as Keras's losses are."""
        teacher_logits, teacher_maps = self._teacher_forward(x)
        # float32 for float16 / bfloat16 / float32 students, float64 for float64.
        dtype = tf.float64 if y_pred.dtype == tf.float64 else tf.float32
        zero = tf.zeros((), dtype)
        label = zero
        if y is not None and self._compile_loss is not None:
            label = tf.cast(self._compile_loss(y, y_pred, sample_weight), dtype)
        if self.teacher_weights is None:
            mean = tf.add_n(teacher_logits) / len(teacher_logits)
            distill = self.distillation_loss(mean, y_pred, sample_weight)
        else:
            distill = tf.add_n(
                [
                    w * self.distillation_loss(t, y_pred, sample_weight)
                    for w, t in zip(self.teacher_weights, teacher_logits, strict=True)
                ]
            )
        distill = tf.cast(distill, dtype)
        attention = zero
        if student_maps:
            attention = tf.add_n(
                [
                    tf.cast(self.attention_loss(t, s, sample_weight), dtype)
                    for s, t in zip(student_maps, teacher_maps, strict=True)
                ]
            )
        # The student's regularization losses: Keras's own aggregation (private
        # in Keras 3, the one compute_loss uses), not weighted by alpha.
        extra = [tf.cast(self._aggregate_additional_loss(loss), dtype) for loss in self.losses]
        total = self.alpha * label + self.beta * distill + self.gamma * attention
        total = tf.add_n([total, *extra])
        return total, label, distill, attention

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        """The total training loss (see the class); Keras's hook, for custom loops."""
        maps = []
        if self.attention:
            y_pred, maps = self._student_forward(x, training=training)
        return self._loss_parts(x, y, y_pred, maps, sample_weight)[0]

    def _step_losses(self, x, y, sample_weight, training):
        y_pred, maps = self._student_forward(x, training=training)
        total, label, distill, attention = self._loss_parts(x, y, y_pred, maps, sample_weight)
        batch = tf.shape(tf.nest.flatten(x)[0])[0]
        # Keras's losses are scaled by 1 / replicas for tf.distribute's sum;
        # the trackers record the per-batch value, as Keras's train_step does.
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        for tracker, value in (
            (self._loss_tracker, total),
            (self.label_loss_tracker, label),
            (self.distillation_loss_tracker, distill),
            (self.attention_loss_tracker, attention),
        ):
            tracker.update_state(value * replicas, sample_weight=batch)
        return y_pred, total

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred, loss = self._step_losses(x, y, sample_weight, training=True)
            scaled = self.optimizer.scale_loss(loss)
        variables = self.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(scaled, variables), variables))
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def test_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred, _ = self._step_losses(x, y, sample_weight, training=False)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        if y is not None and self._compile_metrics is not None:
            self._compile_metrics.update_state(y, y_pred, sample_weight=sample_weight)
        return self.get_metrics_result()

    def save_student(self, filepath, **kwargs):
        """Saves the student alone: a ``.keras`` file (the whole model) or a
        ``.weights.h5`` file (its weights). For a SavedModel or TFLite file,
        pass ``distiller.student`` to ``tapehook.export_savedmodel`` /
        ``tapehook.export_tflite``."""
        path = str(filepath)
        if path.endswith(".weights.h5"):
            return self.student.save_weights(path, **kwargs)
        if path.endswith(".keras"):
            return self.student.save(path, **kwargs)
        raise TapehookError(
            f"Distiller.save_student({path!r}): name a .keras or .weights.h5 file; "
            f"for a SavedModel use tapehook.export_savedmodel(distiller.student, ...)"
        )

    def get_config(self):
        teachers = [keras.saving.serialize_keras_object(t) for t in self.teachers]
        return {
            **super().get_config(),
            "student": keras.saving.serialize_keras_object(self.student),
            "teacher": teachers if len(teachers) > 1 else teachers[0],
            "alpha": self.alpha,
            "beta": self.beta,
            "gamma": self.gamma,
            "temperature": self.temperature,
            "teacher_weights": self.teacher_weights,
            "attention": [list(pair) for pair in self.attention],
            "distillation_loss": keras.saving.serialize_keras_object(self.distillation_loss),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        load = keras.saving.deserialize_keras_object
        teacher = config.pop("teacher")
        config["teacher"] = (
            [load(t) for t in teacher] if isinstance(teacher, list) else load(teacher)
        )
        config["student"] = load(config.pop("student"))
        config["distillation_loss"] = load(config.pop("distillation_loss"))
        return cls(**config)


class StudentCheckpoint(keras.callbacks.ModelCheckpoint):
    """``keras.callbacks.ModelCheckpoint`` (same arguments) that saves a
    Distiller's student alone, monitoring the Distiller's logs (``loss``,
    ``val_loss``, ``val_accuracy``, ...); on any other model it saves the
    model, as ModelCheckpoint does."""

    def set_model(self, model):
        super().set_model(model.student if isinstance(model, Distiller) else model)
