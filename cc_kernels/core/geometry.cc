#include "geometry.h"

#include <algorithm>

namespace tapehook {

namespace {

// Output size and leading pad along one spatial axis, as TF computes them.
std::string AxisGeometry(const char* axis, Padding padding, int64_t in,
                         int64_t k, int64_t stride, int64_t dil,
                         int64_t pad_before, int64_t pad_after, int64_t* out,
                         int64_t* pad) {
  const std::string where = std::string(" along ") + axis;
  if (stride < 1) return "stride must be >= 1" + where;
  if (dil < 1) return "dilation must be >= 1" + where;
  if (in < 0) return "input size must be >= 0" + where;
  if (k < 1) return "filter size must be >= 1" + where;
  const int64_t ek = (k - 1) * dil + 1;
  switch (padding) {
    case Padding::kValid:
      if (in < ek) {
        return "VALID padding needs input size (" + std::to_string(in) +
               ") >= effective filter size (" + std::to_string(ek) + ")" +
               where;
      }
      *out = (in - ek + stride) / stride;
      *pad = 0;
      return "";
    case Padding::kSame: {
      *out = (in + stride - 1) / stride;
      const int64_t total = std::max<int64_t>((*out - 1) * stride + ek - in, 0);
      *pad = total / 2;
      return "";
    }
    case Padding::kExplicit:
      if (pad_before < 0 || pad_after < 0) {
        return "explicit paddings must be >= 0" + where;
      }
      if (in + pad_before + pad_after < ek) {
        return "padded input size (" +
               std::to_string(in + pad_before + pad_after) +
               ") is smaller than effective filter size (" +
               std::to_string(ek) + ")" + where;
      }
      *out = (in + pad_before + pad_after - ek) / stride + 1;
      *pad = pad_before;
      return "";
  }
  return "unknown padding";
}

}  // namespace

std::string ComputeConvGeometry(Padding padding, int64_t pad_t, int64_t pad_b,
                                int64_t pad_l, int64_t pad_r, ConvShape* s) {
  if (s->batch < 0) return "batch must be >= 0";
  if (s->in_c < 1 || s->out_c < 1) {
    return "filter must not have zero elements (in_c and out_c >= 1)";
  }
  std::string err =
      AxisGeometry("height", padding, s->in_h, s->k_h, s->stride_h, s->dil_h,
                   pad_t, pad_b, &s->out_h, &s->pad_top);
  if (!err.empty()) return err;
  return AxisGeometry("width", padding, s->in_w, s->k_w, s->stride_w, s->dil_w,
                      pad_l, pad_r, &s->out_w, &s->pad_left);
}

}  // namespace tapehook
