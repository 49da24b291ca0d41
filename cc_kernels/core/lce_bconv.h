// Larq Compute Engine's binary ops on the core's bitpacked kernels
// (framework-free; cc_kernels/lite adapts them to LiteRT's interpreter).
//
// LCE's layout: the last axis of a tensor packed into int32 words, channel c
// at bit c % 32 of word c / 32, bit 1 meaning -1; channels padded to a whole
// word with 0 bits. On a little-endian CPU two such words are one 64-bit word
// of the core's layout (bitpacked.h: channel c at bit c % 64), so an input
// whose words per pixel are even is read in place.
//
// LceBconv2d's result, with K = k_h * k_w * (channels_in / groups) and
// `count` the xor-popcount of the receptive field (one-padding taps read
// +1), is for float output
//     float(clamp(2 * count)) * multiplier[o] + bias[o]
// with multiplier = -post_mul, bias = post_bias + K * post_mul, and the
// clamp the fused activation's range mapped through 2 * count = K - dot;
// for bitpacked output, bit o is count > thresholds[o]. Zero padding
// (pad_values 0) gives the exact dot of x_hat padded with 0 here, where LCE
// corrects its one-padded sum in float: equal up to float rounding.
#ifndef TAPEHOOK_CORE_LCE_BCONV_H_
#define TAPEHOOK_CORE_LCE_BCONV_H_

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "geometry.h"

namespace tapehook {
namespace lce {

inline int64_t PackedWords(int64_t channels) { return (channels + 31) / 32; }

// rows x channels values to rows x PackedWords(channels) words: bit set
// where x < zero_point (float: x < 0, so -0.0 and NaN give +1, as LCE packs).
void PackSigns(const float* x, int64_t rows, int64_t channels, int32_t* out,
               const ParallelFor& parallel_for);
void PackSignsInt8(const int8_t* x, int64_t rows, int64_t channels,
                   int32_t zero_point, int32_t* out,
                   const ParallelFor& parallel_for);

// The inverse: +1 for bit 0, -1 for bit 1 (int8: zero_bit / one_bit).
void UnpackSigns(const int32_t* in, int64_t rows, int64_t channels, float* out,
                 const ParallelFor& parallel_for);
void UnpackSignsInt8(const int32_t* in, int64_t rows, int64_t channels,
                     int8_t zero_bit, int8_t one_bit, int8_t* out,
                     const ParallelFor& parallel_for);

// TFLite's fused activations (its ActivationFunctionType values).
enum class Activation : int {
  kNone = 0,
  kRelu = 1,
  kReluN1To1 = 2,
  kRelu6 = 3
};

struct BConvAttrs {
  int64_t stride_h = 1, stride_w = 1, dil_h = 1, dil_w = 1;
  bool same = false;  // SAME padding, else VALID
  int pad_value = 0;  // SAME's padding: 0 or 1 (+1)
  int64_t channels_in = 0;
  Activation activation = Activation::kNone;
};

enum class OutputKind { kFloat, kInt8, kBitpacked };

// One LceBconv2d node, prepared once its shapes and constant filter are
// known. Prepare returns "" or what is wrong with the node.
// One elementwise float op on the conv's float output v: operand - v,
// v - operand, v * operand or v + operand, the result clamped to [lo, hi]
// (a fused activation; +-inf for none, TFLite's max-then-min, so a NaN
// stays). The operand is one value, one per output channel, or a tensor of
// the output's shape.
struct EpilogueStep {
  enum class Op { kSubFrom, kSub, kMul, kAdd };
  enum class Operand { kScalar, kChannel, kFull };
  Op op = Op::kAdd;
  Operand operand = Operand::kFull;
  const float* values = nullptr;
  float lo = -std::numeric_limits<float>::infinity();
  float hi = std::numeric_limits<float>::infinity();
};

class BConv2D {
 public:
  BConv2D();
  ~BConv2D();

  // input [batch, in_h, in_w, PackedWords(channels_in)] int32 words;
  // filter [out_c, k_h, k_w, PackedWords(channels_in / groups)] words.
  // post_mul / post_bias [out_c] (float and int8 output), thresholds [out_c]
  // (bitpacked output); output_scale / output_zero_point: int8 only.
  std::string Prepare(const BConvAttrs& attrs, OutputKind kind, int64_t batch,
                      int64_t in_h, int64_t in_w, int64_t in_words,
                      const int64_t filter_dims[4], const int32_t* filter,
                      const float* post_mul, const float* post_bias,
                      const int32_t* thresholds, double output_scale,
                      int32_t output_zero_point);

  // Output [batch, out_h, out_w, out_c] (kFloat / kInt8) or
  // [..., PackedWords(out_c)] (kBitpacked).
  int64_t out_h() const;
  int64_t out_w() const;
  int64_t out_channels() const;  // the output tensor's last axis

  // steps (float output only): elementwise float ops applied to the output
  // in order, each as its own op after this one would (tapehook.lite takes
  // such ops into the conv when it loads a file).
  void Run(const int32_t* input, void* output, const ParallelFor& parallel_for,
           const std::vector<EpilogueStep>* steps = nullptr);

  // The implementation the node runs (plan.h's ImplName).
  const char* impl_name() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// LceBMaxPool2d: the AND of the words each window covers (max of +-1 values;
// SAME padding taps are left out). Returns "" or the error; fills out_h/w.
std::string BMaxPoolGeometry(int64_t in_h, int64_t in_w, int64_t k_h,
                             int64_t k_w, int64_t stride_h, int64_t stride_w,
                             bool same, int64_t* out_h, int64_t* out_w);
void BMaxPool(const int32_t* input, int64_t batch, int64_t in_h, int64_t in_w,
              int64_t words, int64_t k_h, int64_t k_w, int64_t stride_h,
              int64_t stride_w, bool same, int32_t* output,
              const ParallelFor& parallel_for);

}  // namespace lce
}  // namespace tapehook

#endif  // TAPEHOOK_CORE_LCE_BCONV_H_
