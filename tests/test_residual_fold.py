"""tapehook.layers.Add: in inference graphs, the residual add after a batch
norm folded into a binary conv is done by that conv as it writes its outputs
(TapehookBinaryConv2DAffineAdd). References: the same model with Keras's Add
(the folded conv's output plus a separate AddV2: equal to the bit) and with
Keras's batch norm and Add (the unfolded math: equal to float rounding), in
tf.function, Keras predict and eager calls; where the fold must not happen,
that it does not and the result is Keras's."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook
from tapehook.layers import Add, BatchNormalization

from conftest import inference_gradients, taped_inference_op_types

AFFINE, AFFINE_ADD = "TapehookBinaryConv2DAffine", "TapehookBinaryConv2DAffineAdd"
SPECS = {
    "mean_abs": dict(activations=True, scale="mean_abs"),  # Bi-Real-Net's kernels
    "one_padding": dict(activations=True, pad_value=1.0, clip=1.25),  # QuickNet's
    "approx_sign": dict(activations="approx_sign"),
}


def _block(
    add=Add,
    norm=BatchNormalization,
    activation=None,
    spec="mean_abs",
    shortcut="input",
    order="conv_first",
    size=9,
    channels=40,
    read_twice=False,
):
    """inputs -> [x] -> binary 3x3 conv (-> ReLU) -> batch norm -> add(., shortcut).
    shortcut: "input" (the conv's own input x, Bi-Real-Net's and QuickNet's
    identity shortcut: x is also read by the conv), "scaled" (a tensor only the
    add reads, whose buffer the folded op may take over) or "broadcast" (a
    [1, 1, 1, channels] constant: Keras's add broadcasts it)."""
    keras.utils.set_random_seed(7)
    inputs = keras.Input((size, size, channels))
    x = keras.layers.Rescaling(1.5, name="pre")(inputs)  # an intermediate, not the caller's tensor
    z = keras.layers.Conv2D(
        channels, 3, padding="same", use_bias=False, activation=activation, name="binary"
    )(x)
    y = norm(name="bn")(z)
    if shortcut == "input":
        s = x
    elif shortcut == "scaled":
        s = keras.layers.Rescaling(-0.5, name="scaled")(inputs)
    else:
        s = keras.ops.ones((1, 1, 1, channels)) * 0.25
    out = add(name="add")([y, s] if order == "conv_first" else [s, y])
    if read_twice:  # another layer reads the batch norm's output too
        out = keras.layers.Concatenate()([out, y])
    net = keras.Model(inputs, out)
    # fast_layers=False: the references keep Keras's own batch norm and Add.
    tapehook.binarize(net, include="binary", fast_layers=False, **SPECS[spec])
    rng = np.random.default_rng(11)
    for v in net.get_layer("bn").weights:  # off their initial values
        v.assign(
            rng.uniform(0.5, 1.5, v.shape).astype(np.float32) * (-1 if "beta" in v.path else 1)
        )
    return net


def _inputs(shape, seed=1):
    rng = np.random.default_rng(seed)
    return tf.constant((rng.standard_normal(shape) * 2 + 0.5).astype(np.float32))


def _infer(net, x):
    fn = tf.function(lambda t: net(t, training=False))
    types = [op.type for op in fn.get_concrete_function(x).graph.get_operations()]
    return fn(x).numpy(), types


def _pair(**kwargs):
    """The block with tapehook's Add, and with Keras's (the same weights)."""
    ours = _block(**kwargs)
    folded_only = _block(**{**kwargs, "add": keras.layers.Add})
    folded_only.set_weights(ours.get_weights())
    return ours, folded_only


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("activation", [None, "relu"])
@pytest.mark.parametrize("shortcut", ["input", "scaled"])
@pytest.mark.parametrize("order", ["conv_first", "shortcut_first"])
def test_add_folds_into_binary_conv(spec, activation, shortcut, order):
    ours, folded_only = _pair(spec=spec, activation=activation, shortcut=shortcut, order=order)
    unfolded = _block(
        spec=spec,
        activation=activation,
        shortcut=shortcut,
        order=order,
        add=keras.layers.Add,
        norm=keras.layers.BatchNormalization,
    )
    unfolded.set_weights(ours.get_weights())
    x = _inputs((3, 9, 9, 40))
    tapehook.reset_dispatch_counts()
    got, types = _infer(ours, x)
    assert types.count(AFFINE_ADD) == 1
    assert tapehook.dispatch_counts()["compiled"]["forward"] == 1  # the unfused ones pruned
    expected, ref_types = _infer(folded_only, x)
    assert AFFINE in ref_types and AFFINE_ADD not in ref_types
    assert types.count("AddV2") == ref_types.count("AddV2") - 1  # the residual add's
    np.testing.assert_array_equal(got, expected)  # a separate add's sum, to the bit
    reference, _ = _infer(unfolded, x)
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-4)
    # Keras predict folds too; eager calls compute Keras's math.
    np.testing.assert_array_equal(ours.predict(x, verbose=0), expected)
    np.testing.assert_allclose(ours(x, training=False).numpy(), reference, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shortcut", ["input", "scaled"])
def test_add_fold_at_model_sizes(shortcut):
    """Larger maps (the AVX-512 tier packs the input inside its units there):
    the output never overwrites an input the conv still reads."""
    ours, folded_only = _pair(shortcut=shortcut, size=30, channels=64)
    x = _inputs((4, 30, 30, 64))
    got, types = _infer(ours, x)
    assert AFFINE_ADD in types
    np.testing.assert_array_equal(got, _infer(folded_only, x)[0])


def test_add_not_folded_where_it_cannot_be():
    x = _inputs((2, 9, 9, 40))

    def check(**kwargs):
        ours, folded_only = _pair(**kwargs)
        got, types = _infer(ours, x)
        np.testing.assert_array_equal(got, _infer(folded_only, x)[0])
        return AFFINE_ADD in types

    assert check()  # the control: it folds
    assert not check(shortcut="broadcast")  # Keras broadcasts the addend
    assert not check(read_twice=True)  # another layer reads the batch norm's output
    assert not check(norm=keras.layers.BatchNormalization)  # no folded conv before it
    assert not check(spec="mean_abs", activation="tanh")  # tanh: the batch norm does not fold
    # Under a tape (no folding at all: a gradient may be asked for).
    net = _block()

    assert AFFINE_ADD not in taped_inference_op_types(net, x)
    # Three inputs: Keras's add.
    inputs = keras.Input((4,))
    three = keras.Model(inputs, Add()([inputs, inputs, inputs]))
    np.testing.assert_array_equal(three.predict(np.ones((2, 4), np.float32), verbose=0), 3)


@pytest.mark.parametrize("activation", [None, "relu"])
def test_folded_add_gradients(activation):
    """tf.gradients (no tape, so the fold happens) of a folded graph equal
    those of Keras's batch norm and add after the same binary conv."""
    x = _inputs((2, 9, 9, 40))
    ours = _block(activation=activation, shortcut="scaled")
    ref = _block(
        activation=activation,
        shortcut="scaled",
        add=keras.layers.Add,
        norm=keras.layers.BatchNormalization,
    )
    ref.set_weights(ours.get_weights())

    def grads(net):
        variables = [net.get_layer("binary").kernel, *net.get_layer("bn").trainable_variables]
        return inference_gradients(net, x, variables)

    got, types = grads(ours)
    expected, ref_types = grads(ref)
    assert AFFINE_ADD in types and AFFINE_ADD not in ref_types
    assert len(got) == 4
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("shape", [(2, 9, 9, 40), (4, 30, 30, 64)])
def test_add_op_with_its_input_as_addend_eagerly(shape):
    """An eager call given one tensor as the conv's input and the addend (a
    buffer TF could hand to the output, the op reading it as input while it
    writes): the affine op's output plus that tensor, to the bit."""
    lib = tapehook.kernels.library()
    x, w = _inputs(shape), _inputs((3, 3, shape[3], shape[3]), seed=2)
    m, b = _inputs(shape[3:], seed=3), _inputs(shape[3:], seed=4)
    attrs = dict(strides=[1, 1, 1, 1], padding="SAME", activation_estimator="ste_sign")
    expected = lib.tapehook_binary_conv2d_affine(x, w, m, b, **attrs) + x
    got = lib.tapehook_binary_conv2d_affine_add(x, w, m, b, x, **attrs)
    np.testing.assert_array_equal(got.numpy(), expected.numpy())
    # and x itself is untouched
    np.testing.assert_array_equal(x.numpy(), _inputs(shape).numpy())


def test_add_op_rejects_a_misshapen_addend():
    lib = tapehook.kernels.library()
    x, w = _inputs((1, 5, 5, 8)), _inputs((3, 3, 8, 4), seed=2)
    ones = tf.ones([4])
    with pytest.raises(tf.errors.InvalidArgumentError, match="addend must have the output's shape"):
        lib.tapehook_binary_conv2d_affine_add(
            x,
            w,
            ones,
            ones,
            tf.ones([1, 5, 5, 3]),
            strides=[1, 1, 1, 1],
            padding="SAME",
            activation_estimator="ste_sign",
        )


def test_add_serializes():
    layer = Add(name="a")
    clone = keras.layers.deserialize(keras.layers.serialize(layer))
    assert type(clone) is Add and clone.name == "a"
