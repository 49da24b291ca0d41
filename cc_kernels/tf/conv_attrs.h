// Attr parsing and shape checks shared by the CPU (binary_conv_ops.cc) and
// GPU (binary_conv_ops_gpu.cc) kernels of the three tapehook ops.
#ifndef TAPEHOOK_TF_CONV_ATTRS_H_
#define TAPEHOOK_TF_CONV_ATTRS_H_

#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "core/binary_conv.h"
#include "core/plan.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace tapehook {

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

// The backprops' attrs: the conv's, plus backprop_dy, how the AMX kernels
// split dy (core/binary_conv.h DySplit). tapehook.config's backprop_dy sets
// it where the gradient is built; graphs written before it existed: 'exact'.
#define TAPEHOOK_BACKPROP_ATTRS \
  TAPEHOOK_CONV_ATTRS.Attr("backprop_dy: {'exact', 'bf16x2'} = 'exact'")

// Parsed attrs of one op instance.
struct ConvAttrs {
  std::vector<int32_t> strides, dilations;
  std::vector<int64_t> explicit_paddings;
  Padding padding = Padding::kSame;
  Scale scale = Scale::kNone;
  Estimator weight_est = Estimator::kSteSign;
  Estimator act_est = Estimator::kNone;
  // ste_sign's clip as the float attr: for half / bfloat16 / float32
  // inputs (computed in float32) Python rounds it toward zero, so that
  // |t| <= clip holds exactly for the float32 t with |t| <= the spec's clip.
  float clip = 1.0f;
  // The spec's clip as a double, for float64 inputs: the clip_f64_bits
  // attr (the IEEE-754 bits of Python's float), or (double)clip when 0
  // (graphs written before the attr existed).
  double clip_f64 = 1.0;
  // The implementation the policy chose (plan.h); kBest for "" (graphs
  // written before plans existed: SelectBest's choice, as then).
  Impl plan = Impl::kBest;

  // The clip the core compares against in compute type C.
  template <typename C>
  double ClipFor() const {
    return std::is_same_v<C, double> ? clip_f64 : static_cast<double>(clip);
  }
};

// Reads clip and clip_f64_bits into a->clip / a->clip_f64.
inline absl::Status ParseClip(::tensorflow::OpKernelConstruction* ctx,
                              float* clip, double* clip_f64) {
  int64_t bits = 0;
  TF_RETURN_IF_ERROR(ctx->GetAttr("clip", clip));
  TF_RETURN_IF_ERROR(ctx->GetAttr("clip_f64_bits", &bits));
  if (bits == 0) {
    *clip_f64 = static_cast<double>(*clip);
  } else {
    std::memcpy(clip_f64, &bits, sizeof(double));
  }
  if (!(*clip > 0) || !(*clip_f64 > 0)) {
    return ::tensorflow::errors::InvalidArgument("clip must be > 0");
  }
  return absl::OkStatus();
}

inline absl::Status ParseAttrs(::tensorflow::OpKernelConstruction* ctx,
                               ConvAttrs* a) {
  namespace errors = ::tensorflow::errors;
  std::string padding, data_format, scale, w_est, act_est, plan;
  TF_RETURN_IF_ERROR(ctx->GetAttr("strides", &a->strides));
  TF_RETURN_IF_ERROR(ctx->GetAttr("dilations", &a->dilations));
  TF_RETURN_IF_ERROR(ctx->GetAttr("explicit_paddings", &a->explicit_paddings));
  TF_RETURN_IF_ERROR(ctx->GetAttr("padding", &padding));
  TF_RETURN_IF_ERROR(ctx->GetAttr("data_format", &data_format));
  TF_RETURN_IF_ERROR(ctx->GetAttr("scale", &scale));
  TF_RETURN_IF_ERROR(ctx->GetAttr("weight_estimator", &w_est));
  TF_RETURN_IF_ERROR(ctx->GetAttr("activation_estimator", &act_est));
  TF_RETURN_IF_ERROR(ParseClip(ctx, &a->clip, &a->clip_f64));
  TF_RETURN_IF_ERROR(ctx->GetAttr("plan", &plan));
  if (!ParseImpl(plan, &a->plan)) {
    return errors::InvalidArgument(
        "unknown plan '", plan,
        "'; use '', 'portable', 'avx2', 'avx512' or 'amx' (tapehook.dispatch "
        "chooses it)");
  }
  if (data_format != "NHWC") {
    return errors::Unimplemented(
        "tapehook binary Conv2D supports data_format NHWC only; got ",
        data_format, ". Use NHWC (Keras: data_format='channels_last').");
  }
  if (a->strides.size() != 4 || a->dilations.size() != 4) {
    return errors::InvalidArgument("strides and dilations must have 4 entries");
  }
  if (a->strides[0] != 1 || a->strides[3] != 1 || a->dilations[0] != 1 ||
      a->dilations[3] != 1) {
    return errors::InvalidArgument(
        "strides and dilations in the batch and depth dimensions must be 1");
  }
  a->padding = padding == "SAME"    ? Padding::kSame
               : padding == "VALID" ? Padding::kValid
                                    : Padding::kExplicit;
  if (a->padding == Padding::kExplicit && a->explicit_paddings.size() != 8) {
    return errors::InvalidArgument(
        "padding EXPLICIT needs 8 explicit_paddings, got ",
        a->explicit_paddings.size());
  }
  if (!ParseScale(scale, &a->scale) || !ParseEstimator(w_est, &a->weight_est) ||
      !ParseEstimator(act_est, &a->act_est)) {
    return errors::InvalidArgument("unknown scale or estimator attr");
  }
  return absl::OkStatus();
}

// Reads the backprops' backprop_dy attr (TAPEHOOK_BACKPROP_ATTRS).
inline absl::Status ParseDySplit(::tensorflow::OpKernelConstruction* ctx,
                                 DySplit* out) {
  std::string value;
  TF_RETURN_IF_ERROR(ctx->GetAttr("backprop_dy", &value));
  *out = value == "bf16x2" ? DySplit::kBf16x2 : DySplit::kExact;
  return absl::OkStatus();
}

inline absl::Status MakeShape(const ConvAttrs& a,
                              const ::tensorflow::TensorShape& x,
                              const ::tensorflow::TensorShape& w,
                              ConvShape* s) {
  namespace errors = ::tensorflow::errors;
  if (x.dims() != 4 || w.dims() != 4) {
    return errors::InvalidArgument(
        "binary Conv2D needs a 4-D input and a 4-D "
        "filter, got ",
        x.DebugString(), " and ", w.DebugString());
  }
  if (x.dim_size(3) != w.dim_size(2)) {
    return errors::InvalidArgument("input depth ", x.dim_size(3),
                                   " does not match filter in_channels ",
                                   w.dim_size(2));
  }
  s->batch = x.dim_size(0);
  s->in_h = x.dim_size(1);
  s->in_w = x.dim_size(2);
  s->in_c = x.dim_size(3);
  s->k_h = w.dim_size(0);
  s->k_w = w.dim_size(1);
  s->out_c = w.dim_size(3);
  s->stride_h = a.strides[1];
  s->stride_w = a.strides[2];
  s->dil_h = a.dilations[1];
  s->dil_w = a.dilations[2];
  const auto& p = a.explicit_paddings;
  const bool ex = a.padding == Padding::kExplicit;
  std::string err = ComputeConvGeometry(a.padding, ex ? p[2] : 0, ex ? p[3] : 0,
                                        ex ? p[4] : 0, ex ? p[5] : 0, s);
  if (!err.empty()) return errors::InvalidArgument(err);
  return absl::OkStatus();
}

// out_backprop must have the forward's output shape.
inline absl::Status CheckOutBackprop(const ConvShape& s,
                                     const ::tensorflow::Tensor& dy) {
  const ::tensorflow::TensorShape want({s.batch, s.out_h, s.out_w, s.out_c});
  if (dy.shape() == want) return absl::OkStatus();
  return ::tensorflow::errors::InvalidArgument(
      "out_backprop has shape ", dy.shape().DebugString(), ", expected ",
      want.DebugString());
}

// Forward: reads (input, filter), fills s and allocates y [batch, out_h,
// out_w, out_c]. Shared by the CPU and GPU kernels.
inline absl::Status PrepareForward(::tensorflow::OpKernelContext* ctx,
                                   const ConvAttrs& a, ConvShape* s,
                                   ::tensorflow::Tensor** y) {
  TF_RETURN_IF_ERROR(
      MakeShape(a, ctx->input(0).shape(), ctx->input(1).shape(), s));
  return ctx->allocate_output(
      0, ::tensorflow::TensorShape({s->batch, s->out_h, s->out_w, s->out_c}),
      y);
}

// Backprops: reads (input, filter, out_backprop), fills s, checks dY and
// allocates the gradient shaped like the filter (kFilter) or the input.
inline absl::Status PrepareBackprop(::tensorflow::OpKernelContext* ctx,
                                    const ConvAttrs& a, bool filter_grad,
                                    ConvShape* s, ::tensorflow::Tensor** grad) {
  const ::tensorflow::Tensor& x = ctx->input(0);
  const ::tensorflow::Tensor& w = ctx->input(1);
  TF_RETURN_IF_ERROR(MakeShape(a, x.shape(), w.shape(), s));
  TF_RETURN_IF_ERROR(CheckOutBackprop(*s, ctx->input(2)));
  return ctx->allocate_output(0, filter_grad ? w.shape() : x.shape(), grad);
}

// The implementation to run op on conv s (a->plan, or SelectBest's when
// it is empty); an error when the plan cannot run here.
inline absl::Status PlanFor(const ConvAttrs& a, ConvOp op, const ConvShape& s,
                            bool packed_input, bool is_double, Impl* impl) {
  *impl = a.plan;
  const std::string err = ResolvePlan(
      QueryOf(op, s, a.act_est != Estimator::kNone, packed_input, is_double),
      impl);
  if (err.empty()) return absl::OkStatus();
  return ::tensorflow::errors::FailedPrecondition(err);
}

// Executions of the compiled kernels, read by tapehook.dispatch_counts().
enum CountKind {
  kForward = 0,
  kBackpropInput = 1,
  kBackpropFilter = 2,
  kNumKinds
};
// Defined once, in c_api.cc.
void CountDispatch(CountKind kind);

}  // namespace tapehook

#endif  // TAPEHOOK_TF_CONV_ATTRS_H_
