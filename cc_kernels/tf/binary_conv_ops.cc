// Thin TensorFlow wrappers around cc_kernels/core/binary_conv.h, the
// forward ops: op registration, attr parsing, shape checks, dtype adaptation
// and threads. All binary math lives in the core; the backprops are in
// binary_conv_backprop_ops.cc.
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "core/amx_conv.h"
#include "core/binary_conv.h"
#include "core/cpu.h"
#include "core/plan.h"
#include "tf/conv_attrs.h"
#include "tf/op_common.h"
#include "tf/thread_pool.h"

namespace tapehook {
namespace {

// Every forward takes, last, an optional per-input-channel threshold (a list
// of zero or one [in_c] tensors; an empty list in graphs written before it
// existed): x_hat = sign(input - threshold), RSign's shift binarized where
// the conv binarizes its input (tapehook/conv2d.py). CPU, float only.
//
// balance != 'none': the filter input is the latent W and the forward
// binarizes its balanced form (IR-Net; core BalancedFilter), computed as
// the filter is packed and kept with it: an inference forward's (fully
// binary, cache_filter, float32 / float64).
#define TAPEHOOK_FORWARD_ATTRS                            \
  TAPEHOOK_CONV_ATTRS.Attr("num_threshold: int >= 0 = 0") \
      .Attr("balance: {'none', 'mean', 'std'} = 'none'")

REGISTER_OP("TapehookBinaryConv2D")
    .Input("input: T")
    .Input("filter: T")
    .Input("threshold: num_threshold * T")
    .Output("output: T")
    .TAPEHOOK_FORWARD_ATTRS
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
#define TAPEHOOK_AFFINE_ATTRS                              \
  TAPEHOOK_FORWARD_ATTRS.Attr("cache_filter: bool = true") \
      .Attr("activation_clip: float = -1.0")               \
      .Attr("activation_clip_f64_bits: int = 0")           \
      .Attr("beta: float = 5.0")                           \
      .Attr("pad_value: float = 0.0")                      \
      .Attr("relu: bool = false")

REGISTER_OP("TapehookBinaryConv2DAffine")
    .Input("input: T")
    .Input("filter: T")
    .Input("multiplier: T")
    .Input("offset: T")
    .Input("threshold: num_threshold * T")
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
    .Input("threshold: num_threshold * T")
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

template <typename T>
class BinaryConv2DOp : public OpKernel {
 public:
  using C = typename Compute<T>::type;
  explicit BinaryConv2DOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ParseAttrs(ctx, &attrs_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cache_filter", &cache_filter_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_threshold", &num_threshold_));
    OP_REQUIRES(
        ctx,
        num_threshold_ <= 1 &&
            (num_threshold_ == 0 ||
             (std::is_same_v<T, float> && attrs_.act_est != Estimator::kNone)),
        absl::InvalidArgumentError(
            def().op() + ": a threshold (at most one) needs float32 and binary "
                         "input (activation_estimator != 'none')"));
    std::string balance;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("balance", &balance));
    OP_REQUIRES(ctx, ParseBalance(balance, &balance_),
                absl::InvalidArgumentError("unknown balance " + balance));
    OP_REQUIRES(
        ctx,
        balance_ == Balance::kNone ||
            ((std::is_same_v<T, float> || std::is_same_v<T, double>) &&
             attrs_.act_est != Estimator::kNone && cache_filter_),
        absl::InvalidArgumentError(
            def().op() +
            ": balance runs in the fully binary forward with a kept filter: "
            "it needs float32 / float64, activation_estimator != 'none' and "
            "cache_filter = true (elsewhere, binarize a balanced kernel)"));
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
    const C* threshold = nullptr;
    if (num_threshold_ == 1) {
      const Tensor& t = ctx->input(ctx->num_inputs() - 1);
      OP_REQUIRES(
          ctx, t.dims() == 1 && t.dim_size(0) == s.in_c,
          absl::InvalidArgumentError(
              def().op() + ": threshold must be [in_c] = [" +
              std::to_string(s.in_c) + "]; got " + t.shape().DebugString()));
      if constexpr (std::is_same_v<C, T>) threshold = t.flat<T>().data();
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
            if (balance_ != Balance::kNone) {
              const std::vector<C> balanced = BalancedFilter(s, w, balance_);
              return std::make_shared<const BitFilter<C>>(
                  PackBitFilter(s, balanced.data(), attrs_.scale, pool, impl));
            }
            return std::make_shared<const BitFilter<C>>(
                PackBitFilter(s, w, attrs_.scale, pool, impl));
          });
      BinaryConv2DForwardBinary(s, xw.data(), *f, out.data(), pool,
                                affine_ ? &affine : nullptr, threshold);
    } else if (!KeptAmxForward(s, impl, ctx->input(1), xw.data(), out.data(),
                               pool)) {
      Widened<T> ww(ctx->input(1));
      BinaryConv2DForward(s, xw.data(), ww.data(),
                          attrs_.act_est != Estimator::kNone, attrs_.scale,
                          out.data(), pool, impl, threshold);
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
  int num_threshold_ = 0;
  Balance balance_ = Balance::kNone;
  bool affine_ = false;  // TapehookBinaryConv2DAffine(Add)
  bool add_ = false;     // TapehookBinaryConv2DAffineAdd
  bool relu_ = false;
  std::mutex mu_;
  Tensor kept_;  // the filter tensor the kept filter was packed from
  std::shared_ptr<const BitFilter<C>> bit_filter_;
  std::shared_ptr<const amx::ForwardFilter> amx_filter_;
};

REGISTER_KERNEL_BUILDER(Name("TapehookBinaryConv2DAffine")
                            .Device(DEVICE_CPU)
                            .TypeConstraint<float>("T"),
                        BinaryConv2DOp<float>);
REGISTER_KERNEL_BUILDER(Name("TapehookBinaryConv2DAffineAdd")
                            .Device(DEVICE_CPU)
                            .TypeConstraint<float>("T"),
                        BinaryConv2DOp<float>);

#define REGISTER_CPU(T)                                                       \
  REGISTER_KERNEL_BUILDER(                                                    \
      Name("TapehookBinaryConv2D").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      BinaryConv2DOp<T>);

REGISTER_CPU(Eigen::half);
REGISTER_CPU(Eigen::bfloat16);
REGISTER_CPU(float);
REGISTER_CPU(double);

}  // namespace
}  // namespace tapehook
