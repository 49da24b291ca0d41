// Thin TensorFlow wrappers around cc_kernels/core/binary_conv.h: op
// registration, attr parsing, shape checks, dtype adaptation and threads.
// All binary math lives in the core.
#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "core/amx_conv.h"
#include "core/batch_norm.h"
#include "core/binary_conv.h"
#include "core/cpu.h"
#include "core/max_pool.h"
#include "core/pack_input.h"
#include "core/packed_backprop.h"
#include "core/plan.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tf/conv_attrs.h"
#include "tf/thread_pool.h"

#ifndef TAPEHOOK_TF_VERSION
#define TAPEHOOK_TF_VERSION "unknown"
#endif

namespace tapehook {
namespace {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::TensorShapeUtils;
namespace shape_inference = ::tensorflow::shape_inference;
namespace errors = ::tensorflow::errors;

// How many times each compiled kernel (CPU or GPU) ran, in any execution mode.
std::atomic<int64_t> g_counts[kNumKinds];

// Attrs shared by the forward and both backprops, so the gradient can rebuild
// the whole binary spec from the forward op alone (also after SavedModel load).
// clip_f64_bits: the IEEE-754 bits of the spec's clip as a double, for
// float64 inputs (0: use clip). plan: the implementation tapehook.dispatch
// chose (core/plan.h: 'portable', 'avx2', 'avx512', 'amx'); '' picks the best
// this CPU can run, as graphs written before the attr did.
#define TAPEHOOK_CONV_ATTRS                                                \
  Attr("T: {half, bfloat16, float, double}")                               \
      .Attr("strides: list(int)")                                          \
      .Attr("padding: {'SAME', 'VALID', 'EXPLICIT'}")                      \
      .Attr("explicit_paddings: list(int) = []")                           \
      .Attr("data_format: {'NHWC', 'NCHW'} = 'NHWC'")                      \
      .Attr("dilations: list(int) = [1, 1, 1, 1]")                         \
      .Attr("scale: {'none', 'mean_abs'} = 'none'")                        \
      .Attr(                                                               \
          "weight_estimator: {'ste_sign', 'approx_sign', 'swish_sign'} = " \
          "'ste_sign'")                                                    \
      .Attr(                                                               \
          "activation_estimator: {'none', 'ste_sign', 'approx_sign', "     \
          "'swish_sign'} = 'none'")                                        \
      .Attr("clip: float = 1.0")                                           \
      .Attr("clip_f64_bits: int = 0")                                      \
      .Attr("plan: string = ''")

REGISTER_OP("TapehookBinaryConv2D")
    .Input("input: T")
    .Input("filter: T")
    .Output("output: T")
    .TAPEHOOK_CONV_ATTRS
    .Attr("cache_filter: bool = false")
    // The rest of the spec, carried for graph gradients and SavedModels; the
    // forward does not read them. activation_clip < 0: the same as clip;
    // +inf: no mask. pad_value: what padding held (the conv itself is VALID
    // on the padded input then).
    .Attr("activation_clip: float = -1.0")
    .Attr("activation_clip_f64_bits: int = 0")
    .Attr("beta: float = 5.0")
    .Attr("pad_value: float = 0.0")
    .SetShapeFn(::tensorflow::shape_inference::Conv2DShapeWithExplicitPadding)
    .Doc(
        "conv2d(x_hat, alpha * sign(filter)); x_hat = sign(input) when "
        "activation_estimator != 'none'. cache_filter: keep the packed "
        "filter (bitpacked with binary input; the AMX GEMM's sign(W) with "
        "float input, where AMX runs it) while the filter tensor's buffer is "
        "the same (only for filters read from resource variables, whose "
        "writes never touch a buffer that is still referenced).");

// The folded forwards' attrs: the forward's, and relu (max(conv, 0) first).
#define TAPEHOOK_AFFINE_ATTRS                           \
  TAPEHOOK_CONV_ATTRS.Attr("cache_filter: bool = true") \
      .Attr("activation_clip: float = -1.0")            \
      .Attr("activation_clip_f64_bits: int = 0")        \
      .Attr("beta: float = 5.0")                        \
      .Attr("pad_value: float = 0.0")                   \
      .Attr("relu: bool = false")

REGISTER_OP("TapehookBinaryConv2DAffine")
    .Input("input: T")
    .Input("filter: T")
    .Input("multiplier: T")
    .Input("offset: T")
    .Output("output: T")
    .TAPEHOOK_AFFINE_ATTRS
    .SetShapeFn(::tensorflow::shape_inference::Conv2DShapeWithExplicitPadding)
    .Doc(
        "multiplier * relu?(TapehookBinaryConv2D(input, filter)) + offset, per "
        "output channel ([out_c] each), the transform applied as the fully "
        "binary forward writes its outputs: an inference batch norm folded "
        "into the conv (tapehook/layers.py). Binary input only "
        "(activation_estimator other than 'none'), with cache_filter; "
        "float only.");

REGISTER_OP("TapehookBinaryConv2DAffineAdd")
    .Input("input: T")
    .Input("filter: T")
    .Input("multiplier: T")
    .Input("offset: T")
    .Input("addend: T")
    .Output("output: T")
    .TAPEHOOK_AFFINE_ATTRS
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      TF_RETURN_IF_ERROR(
          ::tensorflow::shape_inference::Conv2DShapeWithExplicitPadding(c));
      shape_inference::ShapeHandle merged;
      TF_RETURN_IF_ERROR(c->Merge(c->output(0), c->input(4), &merged));
      c->set_output(0, merged);
      return absl::OkStatus();
    })
    .Doc(
        "TapehookBinaryConv2DAffine(input, filter, multiplier, offset) + "
        "addend (shaped as the output), the sum made as the conv writes its "
        "outputs: an inference batch norm and the residual add after it "
        "folded into the conv (tapehook/layers.py Add). Each output is the "
        "affine op's float output plus the addend, as a separate AddV2 "
        "sums them. The output may take over the addend's buffer.");

REGISTER_OP("TapehookBinaryConv2DBackpropInput")
    .Input("input: T")
    .Input("filter: T")
    .Input("out_backprop: T")
    .Output("input_backprop: T")
    .TAPEHOOK_CONV_ATTRS.SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      return absl::OkStatus();
    });

REGISTER_OP("TapehookBinaryConv2DBackpropFilter")
    .Input("input: T")
    .Input("filter: T")
    .Input("out_backprop: T")
    .Output("filter_backprop: T")
    .TAPEHOOK_CONV_ATTRS.SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(1));
      return absl::OkStatus();
    });

// The core computes in float or double; half and bfloat16 are widened to
// float on the way in and rounded on the way out.
template <typename T>
struct Compute {
  using type = float;
};
template <>
struct Compute<double> {
  using type = double;
};

template <typename T>
class Widened {
 public:
  using C = typename Compute<T>::type;
  explicit Widened(const Tensor& t) {
    if constexpr (std::is_same_v<T, C>) {
      ptr_ = t.flat<T>().data();
    } else {
      auto f = t.flat<T>();
      buf_.resize(f.size());
      for (int64_t i = 0; i < f.size(); ++i) buf_[i] = static_cast<C>(f(i));
      ptr_ = buf_.data();
    }
  }
  const C* data() const { return ptr_; }

 private:
  std::vector<C> buf_;
  const C* ptr_ = nullptr;
};

// Output buffer in compute precision; Store() rounds into the TF tensor.
template <typename T>
class WidenedOut {
 public:
  using C = typename Compute<T>::type;
  explicit WidenedOut(Tensor* t) : t_(t) {
    if constexpr (std::is_same_v<T, C>) {
      ptr_ = t->flat<T>().data();
    } else {
      buf_.resize(t->NumElements());
      ptr_ = buf_.data();
    }
  }
  C* data() { return ptr_; }
  void Store() {
    if constexpr (!std::is_same_v<T, C>) {
      auto f = t_->flat<T>();
      for (int64_t i = 0; i < f.size(); ++i) f(i) = static_cast<T>(buf_[i]);
    }
  }

 private:
  Tensor* t_;
  std::vector<C> buf_;
  C* ptr_ = nullptr;
};

template <typename T>
class BinaryConv2DOp : public OpKernel {
 public:
  using C = typename Compute<T>::type;
  explicit BinaryConv2DOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ParseAttrs(ctx, &attrs_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cache_filter", &cache_filter_));
    add_ = def().op() == "TapehookBinaryConv2DAffineAdd";
    affine_ = add_ || def().op() == "TapehookBinaryConv2DAffine";
    if (affine_) {
      OP_REQUIRES_OK(ctx, ctx->GetAttr("relu", &relu_));
      OP_REQUIRES(
          ctx, attrs_.act_est != Estimator::kNone && cache_filter_,
          absl::InvalidArgumentError(
              def().op() + " runs the fully binary forward: it needs "
                           "activation_estimator != 'none' and cache_filter = "
                           "true"));
    }
  }
  void Compute(OpKernelContext* ctx) override {
    ConvShape s;
    Tensor* y = nullptr;
    if (add_) {
      OP_REQUIRES_OK(ctx, PrepareForwardAdd(ctx, &s, &y));
    } else {
      OP_REQUIRES_OK(ctx, PrepareForward(ctx, attrs_, &s, &y));
    }
    if (y->NumElements() == 0) return;
    Widened<T> xw(ctx->input(0));
    WidenedOut<T> out(y);
    const ParallelFor pool = ThreadPoolOf(ctx);
    OutputAffine<C> affine;
    std::optional<Widened<T>> multiplier, offset;
    if (affine_) {
      for (int i : {2, 3}) {
        OP_REQUIRES(
            ctx,
            ctx->input(i).dims() == 1 && ctx->input(i).dim_size(0) == s.out_c,
            absl::InvalidArgumentError(def().op() +
                                       ": multiplier and offset must be "
                                       "[out_c] = [" +
                                       std::to_string(s.out_c) + "]; got " +
                                       ctx->input(i).shape().DebugString()));
      }
      multiplier.emplace(ctx->input(2));
      offset.emplace(ctx->input(3));
      affine.multiplier = multiplier->data();
      affine.offset = offset->data();
      affine.relu = relu_;
      if (add_) {
        if constexpr (std::is_same_v<C, T>) {
          affine.addend = ctx->input(4).flat<T>().data();
        }
      }
    }
    Impl impl;
    OP_REQUIRES_OK(ctx, PlanFor(attrs_, ConvOp::kForward, s, false,
                                std::is_same_v<C, double>, &impl));
    if (attrs_.act_est != Estimator::kNone && cache_filter_) {
      const std::shared_ptr<const BitFilter<C>> f = Kept<BitFilter<C>>(
          ctx->input(1), &bit_filter_,
          [&](const BitFilter<C>& k) {
            return BitFilterFits(k, s, attrs_.scale, impl);
          },
          [&](const C* w) {
            return std::make_shared<const BitFilter<C>>(
                PackBitFilter(s, w, attrs_.scale, pool, impl));
          });
      BinaryConv2DForwardBinary(s, xw.data(), *f, out.data(), pool,
                                affine_ ? &affine : nullptr);
    } else if (!KeptAmxForward(s, impl, ctx->input(1), xw.data(), out.data(),
                               pool)) {
      Widened<T> ww(ctx->input(1));
      BinaryConv2DForward(s, xw.data(), ww.data(),
                          attrs_.act_est != Estimator::kNone, attrs_.scale,
                          out.data(), pool, impl);
    }
    out.Store();
    CountDispatch(kForward);
  }

 private:
  // PrepareForward for TapehookBinaryConv2DAffineAdd: the addend must have
  // the output's shape; the output takes over the addend's buffer where
  // nothing else holds it (TF's forwarding) and no other input of this op
  // is that buffer: the conv reads its input while it writes outputs, and
  // an eager call given one tensor as both input and addend holds it once.
  absl::Status PrepareForwardAdd(OpKernelContext* ctx, ConvShape* s,
                                 Tensor** y) {
    TF_RETURN_IF_ERROR(
        MakeShape(attrs_, ctx->input(0).shape(), ctx->input(1).shape(), s));
    const TensorShape shape({s->batch, s->out_h, s->out_w, s->out_c});
    if (ctx->input(4).shape() != shape) {
      return absl::InvalidArgumentError(
          "TapehookBinaryConv2DAffineAdd: addend must have the output's "
          "shape " +
          shape.DebugString() + "; got " + ctx->input(4).shape().DebugString());
    }
    for (int i = 0; i < 4; ++i) {
      if (ctx->input(i).SharesBufferWith(ctx->input(4))) {
        return ctx->allocate_output(0, shape, y);
      }
    }
    return ctx->forward_input_or_allocate_output({4}, 0, shape, y);
  }

  // The float-input forward on AMX with a kept filter side (sign(W) as the
  // GEMM's B, alpha); false where it does not run (no cache_filter, binary
  // input, or a plan other than AMX): the caller then runs
  // BinaryConv2DForward.
  bool KeptAmxForward(const ConvShape& s, Impl impl, const Tensor& w,
                      const C* x, C* y, const ParallelFor& pool) {
    if constexpr (std::is_same_v<C, float>) {
      if (!cache_filter_ || attrs_.act_est != Estimator::kNone ||
          impl != Impl::kAmx) {
        return false;
      }
      const std::shared_ptr<const amx::ForwardFilter> f =
          Kept<amx::ForwardFilter>(
              w, &amx_filter_,
              [&](const amx::ForwardFilter& k) {
                return amx::ForwardFilterFits(k, s);
              },
              [&](const float* wp) {
                const std::vector<float> alpha =
                    FilterAlphaFloats(s, wp, attrs_.scale);
                return amx::PackForwardFilter(s, wp, AlphaOrNull(alpha), pool);
              });
      return f != nullptr && amx::ForwardWith(s, x, *f, y, pool);
    }
    return false;
  }

  // The packed filter of w (*slot's kind): the one kept from an earlier
  // call while w is that call's very buffer and fits(kept), else pack(w's
  // values) now, kept. Keeping the Tensor holds a reference to its buffer,
  // so it cannot be freed and reused, and TF's writes to a resource variable
  // whose buffer is referenced elsewhere go to a new buffer (copy on write:
  // AssignVariableOp, the Assign* update ops and the optimizers' Apply* ops
  // all check RefCountIsOne; XLA donates a buffer only then). Same buffer,
  // same shape: same values. The cost: a variable written after such a call
  // is copied once. An op instance keeps one kind: its attrs fix which.
  template <typename F, typename Fits, typename Pack>
  std::shared_ptr<const F> Kept(const Tensor& w, std::shared_ptr<const F>* slot,
                                Fits fits, Pack pack) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (*slot != nullptr && kept_.dtype() == w.dtype() &&
          kept_.shape() == w.shape() &&
          kept_.tensor_data().data() == w.tensor_data().data() &&
          fits(**slot)) {
        return *slot;
      }
    }
    Widened<T> ww(w);
    std::shared_ptr<const F> f = pack(ww.data());
    if (f == nullptr) return f;
    std::lock_guard<std::mutex> lock(mu_);
    kept_ = w;
    *slot = f;
    return f;
  }

  ConvAttrs attrs_;
  bool cache_filter_ = false;
  bool affine_ = false;  // TapehookBinaryConv2DAffine(Add)
  bool add_ = false;     // TapehookBinaryConv2DAffineAdd
  bool relu_ = false;
  std::mutex mu_;
  Tensor kept_;  // the filter tensor the kept filter was packed from
  std::shared_ptr<const BitFilter<C>> bit_filter_;
  std::shared_ptr<const amx::ForwardFilter> amx_filter_;
};

// Both backprops take (input, filter, out_backprop); kFilter selects the core
// call.
template <typename T, bool kFilter>
class BinaryConv2DBackpropOp : public OpKernel {
  static constexpr ConvOp kOp =
      kFilter ? ConvOp::kBackpropFilter : ConvOp::kBackpropInput;

 public:
  explicit BinaryConv2DBackpropOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ParseAttrs(ctx, &attrs_));
  }
  void Compute(OpKernelContext* ctx) override {
    ConvShape s;
    Tensor* grad = nullptr;
    OP_REQUIRES_OK(ctx, PrepareBackprop(ctx, attrs_, kFilter, &s, &grad));
    if (grad->NumElements() == 0) return;
    using C = typename Compute<T>::type;
    Impl impl;
    OP_REQUIRES_OK(
        ctx, PlanFor(attrs_, kOp, s, false, std::is_same_v<C, double>, &impl));
    Widened<T> xw(ctx->input(0)), ww(ctx->input(1)), dyw(ctx->input(2));
    WidenedOut<T> out(grad);
    const double clip = attrs_.ClipFor<C>();
    if (kFilter) {
      BinaryConv2DBackpropFilter(s, xw.data(), ww.data(), dyw.data(),
                                 attrs_.act_est, attrs_.weight_est, clip,
                                 attrs_.scale, out.data(), ThreadPoolOf(ctx),
                                 impl);
    } else {
      BinaryConv2DBackpropInput(s, xw.data(), ww.data(), dyw.data(),
                                attrs_.act_est, clip, attrs_.scale, out.data(),
                                ThreadPoolOf(ctx), impl);
    }
    out.Store();
    CountDispatch(kFilter ? kBackpropFilter : kBackpropInput);
  }

 private:
  ConvAttrs attrs_;
};

// Input 0 (packed bits) with its last dimension replaced by the `channels`
// attr: the shape of the unpacked input. Input 0 has rank `rank`, or any
// rank >= 1 when rank is 0.
absl::Status UnpackedShape(shape_inference::InferenceContext* c, int rank,
                           shape_inference::ShapeHandle* out) {
  int64_t channels;
  TF_RETURN_IF_ERROR(c->GetAttr("channels", &channels));
  shape_inference::ShapeHandle in = c->input(0), prefix;
  TF_RETURN_IF_ERROR(rank > 0 ? c->WithRank(in, rank, &in)
                              : c->WithRankAtLeast(in, 1, &in));
  TF_RETURN_IF_ERROR(c->Subshape(in, 0, -1, &prefix));
  return c->Concatenate(prefix, c->Vector(channels), out);
}

REGISTER_OP("TapehookPackInput")
    .Input("input: T")
    .Output("packed: uint8")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("clip: float = 1.0")
    .Attr("clip_f64_bits: int = 0")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle in = c->input(0), prefix, out;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(in, 1, &in));
      TF_RETURN_IF_ERROR(c->Subshape(in, 0, -1, &prefix));
      shape_inference::DimensionHandle channels = c->Dim(in, -1);
      shape_inference::DimensionHandle bytes =
          c->ValueKnown(channels) ? c->MakeDim(PackedBytes(c->Value(channels)))
                                  : c->UnknownDim();
      TF_RETURN_IF_ERROR(c->Concatenate(prefix, c->Vector(bytes), &out));
      c->set_output(0, out);
      return absl::OkStatus();
    })
    .Doc(
        "Sign and ste_sign mask bits of a binary conv's input "
        "(core/pack_input.h).");

REGISTER_OP("TapehookUnpackInput")
    .Input("packed: uint8")
    .Output("x_hat: T")
    .Output("mask: T")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("channels: int")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle out;
      TF_RETURN_IF_ERROR(UnpackedShape(c, /*rank=*/0, &out));
      c->set_output(0, out);
      c->set_output(1, out);
      return absl::OkStatus();
    });

template <typename T>
class PackInputOp : public OpKernel {
 public:
  explicit PackInputOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ParseClip(ctx, &clip_, &clip_f64_));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    OP_REQUIRES(ctx, x.dims() >= 1,
                errors::InvalidArgument("input must have a channel axis"));
    const int64_t channels = x.dim_size(x.dims() - 1);
    TensorShape shape = x.shape();
    shape.set_dim(x.dims() - 1, PackedBytes(channels));
    Tensor* packed = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &packed));
    if (x.NumElements() == 0) return;
    Widened<T> xw(x);
    using C = typename Compute<T>::type;
    PackSignMask(xw.data(), x.NumElements() / channels, channels,
                 std::is_same_v<C, double> ? clip_f64_ : double{clip_},
                 packed->flat<uint8_t>().data(), ThreadPoolOf(ctx));
  }

 private:
  float clip_;
  double clip_f64_;
};

template <typename T>
class UnpackInputOp : public OpKernel {
 public:
  explicit UnpackInputOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("channels", &channels_));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& packed = ctx->input(0);
    OP_REQUIRES(ctx,
                packed.dims() >= 1 && packed.dim_size(packed.dims() - 1) ==
                                          PackedBytes(channels_),
                errors::InvalidArgument("packed input does not hold ",
                                        channels_, " channels"));
    TensorShape shape = packed.shape();
    shape.set_dim(packed.dims() - 1, channels_);
    Tensor *x_hat = nullptr, *mask = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &x_hat));
    // A graph whose only reader takes the signs (a batch norm's rebuild of
    // the conv output, conv2d.recompute_output) leaves the mask unread: the
    // executor then does not require it, and it is neither allocated nor
    // written (a full-size tensor per rebuilt conv).
    const bool with_mask = ctx->output_required(1);
    if (with_mask) {
      OP_REQUIRES_OK(ctx, ctx->allocate_output(1, shape, &mask));
    }
    if (x_hat->NumElements() == 0) return;
    WidenedOut<T> xo(x_hat);
    std::optional<WidenedOut<T>> mo;
    if (with_mask) mo.emplace(mask);
    UnpackSignMask(packed.flat<uint8_t>().data(),
                   x_hat->NumElements() / channels_, channels_, xo.data(),
                   with_mask ? mo->data() : nullptr, ThreadPoolOf(ctx));
    xo.Store();
    if (with_mask) mo->Store();
  }

 private:
  int64_t channels_;
};

REGISTER_OP("TapehookBinaryConv2DBackpropInputPacked")
    .Input("packed: uint8")
    .Input("filter: T")
    .Input("out_backprop: T")
    .Output("input_backprop: T")
    .TAPEHOOK_CONV_ATTRS.Attr("channels: int")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle out;
      TF_RETURN_IF_ERROR(UnpackedShape(c, /*rank=*/4, &out));
      c->set_output(0, out);
      return absl::OkStatus();
    })
    .Doc(
        "TapehookBinaryConv2DBackpropInput of a ste_sign binary-activation "
        "conv whose input is given as TapehookPackInput bits.");

REGISTER_OP("TapehookBinaryConv2DBackpropFilterPacked")
    .Input("packed: uint8")
    .Input("filter: T")
    .Input("out_backprop: T")
    .Output("filter_backprop: T")
    .TAPEHOOK_CONV_ATTRS.Attr("channels: int")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(1));
      return absl::OkStatus();
    })
    .Doc(
        "TapehookBinaryConv2DBackpropFilter of a ste_sign binary-activation "
        "conv whose input is given as TapehookPackInput bits.");

REGISTER_OP("TapehookEstimatorGradHalf")
    .Input("input: float")
    .Output("derivative: half")
    .Attr("activation_estimator: {'approx_sign', 'swish_sign'}")
    .SetShapeFn(shape_inference::UnchangedShape)
    .Doc(
        "e'(x) of a continuous input estimator in binary16, rounded to "
        "nearest even: what a binary conv's backward keeps of a float32 "
        "input beside its sign bits (core/pack_input.h).");

REGISTER_OP("TapehookScaleByHalf")
    .Input("grad: float")
    .Input("derivative: half")
    .Output("output: float")
    .SetShapeFn(shape_inference::UnchangedShape)
    .Doc("grad * derivative, the binary16 e'(x) widened exactly.");

REGISTER_OP("TapehookEstimatorGradFixed")
    .Input("input: float")
    .Output("derivative: uint16")
    .Attr("activation_estimator: {'approx_sign', 'swish_sign'}")
    .SetShapeFn(shape_inference::UnchangedShape)
    .Doc(
        "e'(x) of a continuous input estimator in 16-bit fixed point over its "
        "range (core/pack_input.h, FixedDerivative): what a binary conv's "
        "backward keeps of a float32 input beside its sign bits by default.");

REGISTER_OP("TapehookScaleByFixed")
    .Input("grad: float")
    .Input("derivative: uint16")
    .Output("output: float")
    .Attr("activation_estimator: {'approx_sign', 'swish_sign'}")
    .SetShapeFn(shape_inference::UnchangedShape)
    .Doc("grad * e'(x), e'(x) from TapehookEstimatorGradFixed's fixed point.");

// The two 16-bit forms of a continuous estimator's e'(x) (core/pack_input.h):
// binary16 (an Eigen::half tensor) or, kFixed, fixed point (a uint16 tensor);
// the core functions read either as uint16_t.
template <bool kFixed>
using Stored16 = std::conditional_t<kFixed, uint16_t, Eigen::half>;

template <bool kFixed>
class EstimatorGrad16Op : public OpKernel {
 public:
  explicit EstimatorGrad16Op(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string name;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("activation_estimator", &name));
    OP_REQUIRES(ctx, ParseEstimator(name, &estimator_),
                errors::InvalidArgument("unknown estimator ", name));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &out));
    if (x.NumElements() == 0) return;
    auto* bits =
        reinterpret_cast<uint16_t*>(out->flat<Stored16<kFixed>>().data());
    (kFixed ? EstimatorGradFixed : EstimatorGradHalf)(
        x.flat<float>().data(), x.NumElements(), estimator_, bits,
        ThreadPoolOf(ctx));
  }

 private:
  Estimator estimator_;
};

template <bool kFixed>
class ScaleBy16Op : public OpKernel {
 public:
  explicit ScaleBy16Op(OpKernelConstruction* ctx) : OpKernel(ctx) {
    if (!kFixed) return;  // binary16 needs no estimator
    std::string name;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("activation_estimator", &name));
    OP_REQUIRES(ctx, ParseEstimator(name, &estimator_),
                errors::InvalidArgument("unknown estimator ", name));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor &grad = ctx->input(0), &derivative = ctx->input(1);
    OP_REQUIRES(ctx, grad.shape() == derivative.shape(),
                errors::InvalidArgument(
                    "grad ", grad.shape().DebugString(), " and derivative ",
                    derivative.shape().DebugString(), " differ in shape"));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(
        ctx, ctx->forward_input_or_allocate_output({0}, 0, grad.shape(), &out));
    if (grad.NumElements() == 0) return;
    const auto* bits = reinterpret_cast<const uint16_t*>(
        derivative.flat<Stored16<kFixed>>().data());
    const float* in = grad.flat<float>().data();
    float* result = out->flat<float>().data();
    if (kFixed) {
      ScaleByFixed(in, bits, grad.NumElements(), estimator_, result,
                   ThreadPoolOf(ctx));
    } else {
      ScaleByHalf(in, bits, grad.NumElements(), result, ThreadPoolOf(ctx));
    }
  }

 private:
  Estimator estimator_ = Estimator::kNone;
};

REGISTER_KERNEL_BUILDER(Name("TapehookEstimatorGradHalf").Device(DEVICE_CPU),
                        EstimatorGrad16Op<false>);
REGISTER_KERNEL_BUILDER(Name("TapehookScaleByHalf").Device(DEVICE_CPU),
                        ScaleBy16Op<false>);
REGISTER_KERNEL_BUILDER(Name("TapehookEstimatorGradFixed").Device(DEVICE_CPU),
                        EstimatorGrad16Op<true>);
REGISTER_KERNEL_BUILDER(Name("TapehookScaleByFixed").Device(DEVICE_CPU),
                        ScaleBy16Op<true>);

REGISTER_OP("TapehookBatchNormGrad")
    .Input("grad: float")
    .Input("x: float")
    .Input("scale: float")
    .Input("mean: float")
    .Input("inv_std: float")
    .Output("x_backprop: float")
    .Output("scale_backprop: float")
    .Output("offset_backprop: float")
    .Attr("relu: bool = false")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      // x_backprop as grad; the two per-channel sums as scale.
      for (int i = 0; i < 3; ++i) c->set_output(i, c->input(i == 0 ? 0 : 2));
      return absl::OkStatus();
    })
    .Doc(
        "Gradient of a training-mode batch norm over the last axis (batch "
        "statistics mean and inv_std; with relu, of the batch norm of "
        "relu(x) followed by the ReLU's backward), written over grad where "
        "TF lets it (core/batch_norm.h).");

class BatchNormGradOp : public OpKernel {
 public:
  explicit BatchNormGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("relu", &relu_));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor &grad = ctx->input(0), &x = ctx->input(1);
    OP_REQUIRES(ctx, grad.shape() == x.shape() && x.dims() >= 1,
                errors::InvalidArgument(
                    "grad ", grad.shape().DebugString(), " and x ",
                    x.shape().DebugString(),
                    " must have the same shape, of rank 1 or more"));
    const int64_t channels = x.dim_size(x.dims() - 1);
    for (int i = 2; i < 5; ++i) {
      OP_REQUIRES(
          ctx,
          ctx->input(i).dims() == 1 && ctx->input(i).dim_size(0) == channels,
          errors::InvalidArgument("scale, mean and inv_std must be [", channels,
                                  "] (x's channels), got ",
                                  ctx->input(i).shape().DebugString()));
    }
    Tensor *dx = nullptr, *dscale = nullptr, *doffset = nullptr;
    OP_REQUIRES_OK(
        ctx, ctx->forward_input_or_allocate_output({0}, 0, grad.shape(), &dx));
    OP_REQUIRES_OK(ctx,
                   ctx->allocate_output(1, TensorShape({channels}), &dscale));
    OP_REQUIRES_OK(ctx,
                   ctx->allocate_output(2, TensorShape({channels}), &doffset));
    const int64_t rows = channels == 0 ? 0 : x.NumElements() / channels;
    if (channels == 0) return;
    BatchNormGrad(grad.flat<float>().data(), x.flat<float>().data(), rows,
                  channels, ctx->input(2).flat<float>().data(),
                  ctx->input(3).flat<float>().data(),
                  ctx->input(4).flat<float>().data(), relu_,
                  dx->flat<float>().data(), dscale->flat<float>().data(),
                  doffset->flat<float>().data(), ThreadPoolOf(ctx));
  }

 private:
  bool relu_ = false;
};

REGISTER_KERNEL_BUILDER(Name("TapehookBatchNormGrad").Device(DEVICE_CPU),
                        BatchNormGradOp);

REGISTER_OP("TapehookMaxPoolArgmax")
    .Input("input: float")
    .Output("output: float")
    .Output("argmax: int32")
    .Attr("ksize: list(int) >= 4")
    .Attr("strides: list(int) >= 4")
    .Attr("padding: {'SAME', 'VALID'}")
    .SetShapeFn(shape_inference::MaxPoolShape)
    .Doc(
        "NHWC max pool and each window's argmax within its image, as "
        "MaxPoolWithArgmax(include_batch_in_index=False) gives it "
        "(core/max_pool.h).");

REGISTER_OP("TapehookMaxPoolTaps")
    .Input("input: float")
    .Output("output: float")
    .Output("taps: int8")
    .Attr("ksize: list(int) >= 4")
    .Attr("strides: list(int) >= 4")
    .Attr("padding: {'SAME', 'VALID'}")
    .Attr("relu: bool = false")
    .SetShapeFn(shape_inference::MaxPoolShape)
    .Doc(
        "NHWC max pool and each window's maximum as its tap within the "
        "window, one byte; with relu (input a ReLU's output), dead taps where "
        "the maximum is not > 0 (core/max_pool.h MaxPoolTaps).");

REGISTER_OP("TapehookMaxPoolTapsGrad")
    .Input("grad: float")
    .Input("taps: int8")
    .Input("input_shape: int32")
    .Output("backprop: float")
    .Attr("ksize: list(int) >= 4")
    .Attr("strides: list(int) >= 4")
    .Attr("padding: {'SAME', 'VALID'}")
    .Attr("relu: bool = false")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle shape;
      TF_RETURN_IF_ERROR(c->MakeShapeFromShapeTensor(2, &shape));
      TF_RETURN_IF_ERROR(c->WithRank(shape, 4, &shape));
      c->set_output(0, shape);
      return absl::OkStatus();
    })
    .Doc(
        "The input gradient of TapehookMaxPoolTaps from its taps; with relu, "
        "that of the ReLU's input (core/max_pool.h MaxPoolTapsBackprop).");

REGISTER_OP("TapehookMaxPoolTapsGather")
    .Input("values: float")
    .Input("taps: int8")
    .Output("output: float")
    .Attr("ksize: list(int) >= 4")
    .Attr("strides: list(int) >= 4")
    .Attr("padding: {'SAME', 'VALID'}")
    .Attr("relu: bool = false")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(1));
      return absl::OkStatus();
    })
    .Doc(
        "values (the pool's input's shape) read at each tap: the derivative "
        "of TapehookMaxPoolTapsGrad in its grad (core/max_pool.h "
        "MaxPoolTapsGather).");

// The window and strides of the pool ops, and their geometry on an input.
class PoolOpBase : public OpKernel {
 public:
  explicit PoolOpBase(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::vector<int32_t> ksize, strides;
    std::string padding;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("ksize", &ksize));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("strides", &strides));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("padding", &padding));
    OP_REQUIRES(ctx,
                ksize.size() == 4 && strides.size() == 4 && ksize[0] == 1 &&
                    ksize[3] == 1 && strides[0] == 1 && strides[3] == 1,
                errors::InvalidArgument(
                    "ksize and strides are [1, h, w, 1] (NHWC, spatial only)"));
    shape_.k_h = ksize[1];
    shape_.k_w = ksize[2];
    shape_.stride_h = strides[1];
    shape_.stride_w = strides[2];
    same_ = padding == "SAME";
  }

 protected:
  // The pool's geometry on an NHWC input of `dims`, or false (the error set
  // on ctx).
  bool Geometry(OpKernelContext* ctx, const TensorShape& dims, ConvShape* s) {
    if (dims.dims() != 4) {
      ctx->CtxFailure(errors::InvalidArgument("input must be NHWC, got shape ",
                                              dims.DebugString()));
      return false;
    }
    *s = shape_;
    s->batch = dims.dim_size(0);
    s->in_h = dims.dim_size(1);
    s->in_w = dims.dim_size(2);
    // The conv geometry with the window as filter (channels play no part:
    // 1 passes its filter check also for an input without channels).
    s->in_c = s->out_c = 1;
    const std::string problem = ComputeConvGeometry(
        same_ ? Padding::kSame : Padding::kValid, 0, 0, 0, 0, s);
    if (!problem.empty()) {
      ctx->CtxFailure(errors::InvalidArgument(problem));
      return false;
    }
    s->in_c = s->out_c = dims.dim_size(3);
    return true;
  }

  // The pool's output and what it keeps (output shape on s); false where
  // an error is set or the output is empty.
  static bool AllocatePooled(OpKernelContext* ctx, const ConvShape& s,
                             Tensor** y, Tensor** kept) {
    const TensorShape out_shape({s.batch, s.out_h, s.out_w, s.in_c});
    for (int index = 0; index < 2; ++index) {
      const auto status =
          ctx->allocate_output(index, out_shape, index == 0 ? y : kept);
      if (!status.ok()) {
        ctx->CtxFailure(status);
        return false;
      }
    }
    return (*y)->NumElements() > 0;
  }

  // Whether t has the pool's output shape on s (else the error set).
  bool IsOutputShaped(OpKernelContext* ctx, const ConvShape& s, const Tensor& t,
                      const char* what) {
    const TensorShape want({s.batch, s.out_h, s.out_w, s.in_c});
    if (t.shape() == want) return true;
    ctx->CtxFailure(
        errors::InvalidArgument(what, " has shape ", t.shape().DebugString(),
                                "; the pool's output is ", want.DebugString()));
    return false;
  }

  ConvShape shape_;  // the window and strides
  bool same_ = false;
};

// The ops of one-byte taps (core/max_pool.h MaxPoolTaps): their relu attr.
class TapsOpBase : public PoolOpBase {
 public:
  explicit TapsOpBase(OpKernelConstruction* ctx) : PoolOpBase(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("relu", &relu_));
  }

 protected:
  // The error of taps that MaxPoolTaps did not make for this geometry.
  static void BadTaps(OpKernelContext* ctx) {
    ctx->CtxFailure(errors::InvalidArgument(
        "taps name a position outside their window or the image: pass the "
        "taps TapehookMaxPoolTaps gave for this input shape, ksize, strides "
        "and padding"));
  }

  bool TapsFit(OpKernelContext* ctx) {
    if (shape_.k_h * shape_.k_w <= kMaxPoolTaps) return true;
    ctx->CtxFailure(
        errors::InvalidArgument("a ", shape_.k_h, "x", shape_.k_w,
                                " window has more than ", kMaxPoolTaps,
                                " taps: one byte cannot name them (use "
                                "TapehookMaxPoolArgmax)"));
    return false;
  }

  bool relu_ = false;
};

class MaxPoolArgmaxOp : public PoolOpBase {
 public:
  using PoolOpBase::PoolOpBase;
  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    ConvShape s;
    if (!Geometry(ctx, x.shape(), &s)) return;
    OP_REQUIRES(ctx, s.in_h * s.in_w * s.in_c < (int64_t{1} << 31),
                errors::InvalidArgument("an image of ", x.shape().DebugString(),
                                        " has 2**31 elements or more: int32 "
                                        "indices cannot address it"));
    Tensor *y = nullptr, *argmax = nullptr;
    if (!AllocatePooled(ctx, s, &y, &argmax)) return;
    MaxPoolArgmax(s, x.flat<float>().data(), y->flat<float>().data(),
                  argmax->flat<int32_t>().data(), ThreadPoolOf(ctx));
  }
};

class MaxPoolTapsOp : public TapsOpBase {
 public:
  using TapsOpBase::TapsOpBase;
  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    ConvShape s;
    if (!TapsFit(ctx) || !Geometry(ctx, x.shape(), &s)) return;
    Tensor *y = nullptr, *taps = nullptr;
    if (!AllocatePooled(ctx, s, &y, &taps)) return;
    MaxPoolTaps(s, x.flat<float>().data(), relu_, y->flat<float>().data(),
                taps->flat<int8_t>().data(), ThreadPoolOf(ctx));
  }
};

class MaxPoolTapsGradOp : public TapsOpBase {
 public:
  using TapsOpBase::TapsOpBase;
  void Compute(OpKernelContext* ctx) override {
    const Tensor &dy = ctx->input(0), &taps = ctx->input(1);
    const Tensor& dims = ctx->input(2);
    OP_REQUIRES(ctx, dims.dims() == 1 && dims.NumElements() == 4,
                errors::InvalidArgument("input_shape is the pool's NHWC input "
                                        "shape, 4 values; got ",
                                        dims.shape().DebugString()));
    TensorShape in_shape;
    OP_REQUIRES_OK(ctx,
                   TensorShapeUtils::MakeShape(dims.vec<int32_t>(), &in_shape));
    ConvShape s;
    if (!TapsFit(ctx) || !Geometry(ctx, in_shape, &s) ||
        !IsOutputShaped(ctx, s, dy, "grad") ||
        !IsOutputShaped(ctx, s, taps, "taps"))
      return;
    Tensor* dx = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, in_shape, &dx));
    if (dx->NumElements() == 0) return;
    if (!MaxPoolTapsBackprop(s, dy.flat<float>().data(),
                             taps.flat<int8_t>().data(), relu_,
                             dx->flat<float>().data(), ThreadPoolOf(ctx))) {
      BadTaps(ctx);
    }
  }
};

class MaxPoolTapsGatherOp : public TapsOpBase {
 public:
  using TapsOpBase::TapsOpBase;
  void Compute(OpKernelContext* ctx) override {
    const Tensor &v = ctx->input(0), &taps = ctx->input(1);
    ConvShape s;
    if (!TapsFit(ctx) || !Geometry(ctx, v.shape(), &s) ||
        !IsOutputShaped(ctx, s, taps, "taps"))
      return;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, taps.shape(), &out));
    if (out->NumElements() == 0) return;
    if (!MaxPoolTapsGather(s, v.flat<float>().data(),
                           taps.flat<int8_t>().data(), relu_,
                           out->flat<float>().data(), ThreadPoolOf(ctx))) {
      BadTaps(ctx);
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("TapehookMaxPoolArgmax").Device(DEVICE_CPU),
                        MaxPoolArgmaxOp);
REGISTER_KERNEL_BUILDER(Name("TapehookMaxPoolTaps").Device(DEVICE_CPU),
                        MaxPoolTapsOp);
REGISTER_KERNEL_BUILDER(Name("TapehookMaxPoolTapsGrad")
                            .Device(DEVICE_CPU)
                            .HostMemory("input_shape"),
                        MaxPoolTapsGradOp);
REGISTER_KERNEL_BUILDER(Name("TapehookMaxPoolTapsGather").Device(DEVICE_CPU),
                        MaxPoolTapsGatherOp);

// The backprops reading the input as packed bits (core/pack_input.h).
template <typename T, bool kFilter>
class PackedBackpropOp : public OpKernel {
 public:
  explicit PackedBackpropOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ParseAttrs(ctx, &attrs_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("channels", &channels_));
    OP_REQUIRES(ctx, attrs_.act_est == Estimator::kSteSign,
                errors::InvalidArgument(
                    "packed input bits hold the ste_sign mask only; use "
                    "activation_estimator='ste_sign'"));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& packed = ctx->input(0);
    OP_REQUIRES(
        ctx, packed.dims() == 4 && packed.dim_size(3) == PackedBytes(channels_),
        errors::InvalidArgument("packed input ", packed.shape().DebugString(),
                                " does not hold ", channels_, " channels"));
    TensorShape x_shape = packed.shape();
    x_shape.set_dim(3, channels_);
    const Tensor& w = ctx->input(1);
    ConvShape s;
    OP_REQUIRES_OK(ctx, MakeShape(attrs_, x_shape, w.shape(), &s));
    OP_REQUIRES_OK(ctx, CheckOutBackprop(s, ctx->input(2)));
    Tensor* grad = nullptr;
    OP_REQUIRES_OK(
        ctx, ctx->allocate_output(0, kFilter ? w.shape() : x_shape, &grad));
    if (grad->NumElements() == 0) return;
    using C = typename Compute<T>::type;
    Impl impl;
    OP_REQUIRES_OK(
        ctx, PlanFor(attrs_,
                     kFilter ? ConvOp::kBackpropFilter : ConvOp::kBackpropInput,
                     s, true, std::is_same_v<C, double>, &impl));
    Widened<T> ww(w), dyw(ctx->input(2));
    WidenedOut<T> out(grad);
    const uint8_t* bits = packed.flat<uint8_t>().data();
    const double clip = attrs_.ClipFor<C>();
    if (kFilter) {
      BinaryConv2DBackpropFilterPacked(s, bits, ww.data(), dyw.data(),
                                       attrs_.weight_est, clip, attrs_.scale,
                                       out.data(), ThreadPoolOf(ctx), impl);
    } else {
      BinaryConv2DBackpropInputPacked(s, bits, ww.data(), dyw.data(), clip,
                                      attrs_.scale, out.data(),
                                      ThreadPoolOf(ctx), impl);
    }
    out.Store();
    CountDispatch(kFilter ? kBackpropFilter : kBackpropInput);
  }

 private:
  ConvAttrs attrs_;
  int64_t channels_;
};

template <typename T>
using PackedBackpropInputOp = PackedBackpropOp<T, false>;
template <typename T>
using PackedBackpropFilterOp = PackedBackpropOp<T, true>;
template <typename T>
using BackpropInputOp = BinaryConv2DBackpropOp<T, false>;
template <typename T>
using BackpropFilterOp = BinaryConv2DBackpropOp<T, true>;

#define REGISTER_CPU(T)                                                       \
  REGISTER_KERNEL_BUILDER(                                                    \
      Name("TapehookBinaryConv2D").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      BinaryConv2DOp<T>);                                                     \
  REGISTER_KERNEL_BUILDER(Name("TapehookBinaryConv2DBackpropInput")           \
                              .Device(DEVICE_CPU)                             \
                              .TypeConstraint<T>("T"),                        \
                          BackpropInputOp<T>);                                \
  REGISTER_KERNEL_BUILDER(Name("TapehookBinaryConv2DBackpropFilter")          \
                              .Device(DEVICE_CPU)                             \
                              .TypeConstraint<T>("T"),                        \
                          BackpropFilterOp<T>);                               \
  REGISTER_KERNEL_BUILDER(                                                    \
      Name("TapehookPackInput").Device(DEVICE_CPU).TypeConstraint<T>("T"),    \
      PackInputOp<T>);                                                        \
  REGISTER_KERNEL_BUILDER(                                                    \
      Name("TapehookUnpackInput").Device(DEVICE_CPU).TypeConstraint<T>("T"),  \
      UnpackInputOp<T>);                                                      \
  REGISTER_KERNEL_BUILDER(Name("TapehookBinaryConv2DBackpropInputPacked")     \
                              .Device(DEVICE_CPU)                             \
                              .TypeConstraint<T>("T"),                        \
                          PackedBackpropInputOp<T>);                          \
  REGISTER_KERNEL_BUILDER(Name("TapehookBinaryConv2DBackpropFilterPacked")    \
                              .Device(DEVICE_CPU)                             \
                              .TypeConstraint<T>("T"),                        \
                          PackedBackpropFilterOp<T>);

REGISTER_KERNEL_BUILDER(Name("TapehookBinaryConv2DAffine")
                            .Device(DEVICE_CPU)
                            .TypeConstraint<float>("T"),
                        BinaryConv2DOp<float>);
REGISTER_KERNEL_BUILDER(Name("TapehookBinaryConv2DAffineAdd")
                            .Device(DEVICE_CPU)
                            .TypeConstraint<float>("T"),
                        BinaryConv2DOp<float>);

REGISTER_CPU(Eigen::half);
REGISTER_CPU(Eigen::bfloat16);
REGISTER_CPU(float);
REGISTER_CPU(double);

}  // namespace

void CountDispatch(CountKind kind) {
  g_counts[kind].fetch_add(1, std::memory_order_relaxed);
}

}  // namespace tapehook

// Plain C entry points read with ctypes: dispatch counters and build facts.
extern "C" {
int64_t tapehook_dispatch_count(int kind) {
  if (kind < 0 || kind >= tapehook::kNumKinds) return -1;
  return tapehook::g_counts[kind].load(std::memory_order_relaxed);
}
void tapehook_reset_dispatch_counts() {
  for (auto& c : tapehook::g_counts) c.store(0, std::memory_order_relaxed);
}
const char* tapehook_built_tf_version() { return TAPEHOOK_TF_VERSION; }
// 1 when the float-operand kernels can run on AMX (see core/amx_conv.h).
int tapehook_amx_usable() { return tapehook::amx::Usable() ? 1 : 0; }

// The capability query (core/plan.h) for tapehook.dispatch: bit (1 << impl)
// per implementation that can run the conv, impl numbered as
// tapehook::Impl. geometry: batch, in_h, in_w, in_c, out_c, k_h, k_w, out_h,
// out_w, stride_h, stride_w, dil_h, dil_w, pad_top, pad_left (-1: unknown).
uint32_t tapehook_conv_capabilities(int op, int binary_input, int packed_input,
                                    int is_double, const int64_t* geometry) {
  if (op < 0 || op > 2) return 0;
  tapehook::ConvQuery q;
  q.op = static_cast<tapehook::ConvOp>(op);
  q.binary_input = binary_input != 0;
  q.packed_input = packed_input != 0;
  q.is_double = is_double != 0;
  int64_t* fields[] = {&q.batch, &q.in_h,     &q.in_w,     &q.in_c,
                       &q.out_c, &q.k_h,      &q.k_w,      &q.out_h,
                       &q.out_w, &q.stride_h, &q.stride_w, &q.dil_h,
                       &q.dil_w, &q.pad_top,  &q.pad_left};
  for (int i = 0; i < 15; ++i) *fields[i] = geometry[i];
  return tapehook::Capabilities(q);
}

// Test hook: the TAPEHOOK_NO_* switches in effect (bits: 1 no AMX, 2 no
// AVX-512, 4 no AVX2), or -1 to go back to the environment's.
void tapehook_set_switches_for_test(int bits) {
  if (bits < 0) return tapehook::cpu::ClearSwitchesForTest();
  tapehook::cpu::SetSwitchesForTest(
      {(bits & 1) != 0, (bits & 2) != 0, (bits & 4) != 0});
}
}
