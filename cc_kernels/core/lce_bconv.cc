#include "lce_bconv.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "bitpacked.h"
#include "conv_util.h"
#include "cpu.h"
#include "plan.h"

namespace tapehook {
namespace lce {

namespace {

inline float* float_out(void* output) { return static_cast<float*>(output); }

// LCE's float output transform of n dot products: x = clamp(K - dot) (exact
// in float: dot and K are integers far below 2^24, the clamp bounds
// integers), then x * multiplier + bias, two roundings as LCE makes them.
// `out` may be `dots` itself (a conv of one group writes in place): each
// element is read before it is written, so the loop vectorizes.
void FloatOutputs(const float* dots, int64_t n, float k, float lo, float hi,
                  const float* multiplier, const float* bias, float* out) {
#pragma GCC ivdep
  for (int64_t o = 0; o < n; ++o) {
    float x = k - dots[o];
    x = x < lo ? lo : x;
    x = x > hi ? hi : x;
    out[o] = x * multiplier[o] + bias[o];
  }
}

// One step on n outputs with operand values a[o] (kOne: a[0] for all),
// each its own IEEE op and clamp, as the elementwise op it stands for; the
// branch-free form vectorizes.
template <EpilogueStep::Op kOp, bool kOne>
void StepOutputs(const float* a, int64_t n, float lo, float hi, float* out) {
  const float a0 = a[0];
#pragma GCC ivdep
  for (int64_t o = 0; o < n; ++o) {
    const float x = kOne ? a0 : a[o], v = out[o];
    float r = kOp == EpilogueStep::Op::kSubFrom ? x - v
              : kOp == EpilogueStep::Op::kSub   ? v - x
              : kOp == EpilogueStep::Op::kMul   ? v * x
                                                : v + x;
    r = r < lo ? lo : r;
    r = r > hi ? hi : r;
    out[o] = r;
  }
}

template <EpilogueStep::Op kOp>
void Step(const float* a, bool one, int64_t n, float lo, float hi, float* out) {
  if (one) {
    StepOutputs<kOp, true>(a, n, lo, hi, out);
  } else {
    StepOutputs<kOp, false>(a, n, lo, hi, out);
  }
}

// The steps on outputs [first, first + n) of output pixels [p, p + rows)
// (N channels each; out at pixel p's first output): a step whose operand is
// not per channel runs over the rows at once where they are contiguous
// (n == N), the others a row at a time.
void ApplySteps(const std::vector<EpilogueStep>& steps, int64_t p, int64_t rows,
                int64_t N, int64_t first, int64_t n, float* out) {
  using Op = EpilogueStep::Op;
  using Operand = EpilogueStep::Operand;
  for (const EpilogueStep& s : steps) {
    const bool one = s.operand == Operand::kScalar;
    const bool whole = n == N && s.operand != Operand::kChannel;
    for (int64_t r = 0; r < (whole ? 1 : rows); ++r) {
      const float* a = s.values;
      if (s.operand == Operand::kChannel) a += first;
      if (s.operand == Operand::kFull) a += (p + r) * N + first;
      const int64_t len = whole ? rows * N : n;
      float* o = out + r * N;
      if (s.op == Op::kSubFrom) {
        Step<Op::kSubFrom>(a, one, len, s.lo, s.hi, o);
      } else if (s.op == Op::kSub) {
        Step<Op::kSub>(a, one, len, s.lo, s.hi, o);
      } else if (s.op == Op::kMul) {
        Step<Op::kMul>(a, one, len, s.lo, s.hi, o);
      } else {
        Step<Op::kAdd>(a, one, len, s.lo, s.hi, o);
      }
    }
  }
}

// The same, rounded to nearest (ties away from zero, as std::round) and
// saturated to int8.
void Int8Outputs(const float* dots, int64_t n, float k, float lo, float hi,
                 const float* multiplier, const float* bias, int8_t* out) {
  for (int64_t o = 0; o < n; ++o) {
    float x = k - dots[o];
    x = x < lo ? lo : x;
    x = x > hi ? hi : x;
    const float r = std::round(x * multiplier[o] + bias[o]);
    out[o] = static_cast<int8_t>(r < -128.0f  ? -128.0f
                                 : r > 127.0f ? 127.0f
                                              : r);
  }
}

// Bit first + o of `words` (zeroed before) set where count = (K - dot) / 2
// exceeds thresholds[o]: LCE's bitpacked output.
void BitpackedOutputs(const float* dots, int64_t n, int32_t k,
                      const int32_t* thresholds, int32_t* words,
                      int64_t first) {
  for (int64_t o = 0; o < n; ++o) {
    const int32_t twice = k - static_cast<int32_t>(dots[o]);
    if (twice / 2 > thresholds[o]) {
      const int64_t bit = first + o;
      words[bit / 32] = static_cast<int32_t>(
          static_cast<uint32_t>(words[bit / 32]) | 1u << (bit % 32));
    }
  }
}

template <typename T, typename Less>
void PackRows(const T* x, int64_t rows, int64_t channels, int32_t* out,
              const ParallelFor& parallel_for, Less negative) {
  const int64_t words = PackedWords(channels);
  parallel_for(rows, channels + 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * channels;
      for (int64_t w = 0; w < words; ++w) {
        uint32_t bits = 0;
        const int64_t n = std::min<int64_t>(32, channels - w * 32);
        for (int64_t b = 0; b < n; ++b) {
          bits |= static_cast<uint32_t>(negative(xr[w * 32 + b])) << b;
        }
        out[r * words + w] = static_cast<int32_t>(bits);
      }
    }
  });
}

template <typename T>
void UnpackRows(const int32_t* in, int64_t rows, int64_t channels, T zero_bit,
                T one_bit, T* out, const ParallelFor& parallel_for) {
  const int64_t words = PackedWords(channels);
  parallel_for(rows, channels + 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = 0; c < channels; ++c) {
        const uint32_t word = static_cast<uint32_t>(in[r * words + c / 32]);
        out[r * channels + c] = (word >> (c % 32) & 1u) ? one_bit : zero_bit;
      }
    }
  });
}

// TFLite's CalculateActivationRange for int32 outputs.
void ActivationRange(Activation a, int32_t* lo, int32_t* hi) {
  *lo = std::numeric_limits<int32_t>::lowest();
  *hi = std::numeric_limits<int32_t>::max();
  if (a == Activation::kRelu) *lo = 0;
  if (a == Activation::kRelu6) *lo = 0, *hi = 6;
  if (a == Activation::kReluN1To1) *lo = -1, *hi = 1;
}

}  // namespace

#if TAPEHOOK_HAVE_AVX512_PATH
namespace {

// PackRows' float form on AVX-512F, a row at a time: one ordered x < 0
// compare per 16 values (NaN and -0.0 give 0 bits, as LCE packs), two to a
// word; masked loads for the last word never read past the row.
__attribute__((target("avx512f"))) void PackRows512(const float* x,
                                                    int64_t rows,
                                                    int64_t channels,
                                                    int32_t* out) {
  const __m512 zero = _mm512_setzero_ps();
  const int64_t words = PackedWords(channels);
  for (int64_t r = 0; r < rows; ++r, x += channels, out += words) {
    for (int64_t w = 0; w < words; ++w) {
      uint32_t bits = 0;
      for (int h = 0; h < 2 && w * 32 + 16 * h < channels; ++h) {
        const int64_t at = w * 32 + 16 * h, left = channels - at;
        const __mmask16 k = left >= 16
                                ? static_cast<__mmask16>(0xffff)
                                : static_cast<__mmask16>((1u << left) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(k, x + at);
        bits |= static_cast<uint32_t>(
                    _mm512_mask_cmp_ps_mask(k, v, zero, _CMP_LT_OQ))
                << (16 * h);
      }
      out[w] = static_cast<int32_t>(bits);
    }
  }
}

}  // namespace
#endif

#if TAPEHOOK_HAVE_AVX2_PATH
namespace {

// The same on AVX2: an ordered x < 0 compare per 8 values (vmovmskps), four
// to a word; the last channels % 8 values of a row one at a time.
TAPEHOOK_AVX2 void PackRows256(const float* x, int64_t rows, int64_t channels,
                               int32_t* out) {
  const __m256 zero = _mm256_setzero_ps();
  const int64_t words = PackedWords(channels), whole = channels / 8 * 8;
  for (int64_t r = 0; r < rows; ++r, x += channels, out += words) {
    std::fill_n(out, words, 0);
    for (int64_t c = 0; c < whole; c += 8) {
      const uint32_t bits = static_cast<uint32_t>(_mm256_movemask_ps(
          _mm256_cmp_ps(_mm256_loadu_ps(x + c), zero, _CMP_LT_OQ)));
      out[c / 32] = static_cast<int32_t>(static_cast<uint32_t>(out[c / 32]) |
                                         bits << (c % 32));
    }
    for (int64_t c = whole; c < channels; ++c) {
      if (x[c] < 0.0f) {
        out[c / 32] = static_cast<int32_t>(static_cast<uint32_t>(out[c / 32]) |
                                           1u << (c % 32));
      }
    }
  }
}

}  // namespace
#endif

void PackSigns(const float* x, int64_t rows, int64_t channels, int32_t* out,
               const ParallelFor& parallel_for) {
  const int64_t words = PackedWords(channels);
#if TAPEHOOK_HAVE_AVX512_PATH
  if (cpu::Float512()) {
    parallel_for(rows, channels / 8 + 1, [&](int64_t r0, int64_t r1) {
      PackRows512(x + r0 * channels, r1 - r0, channels, out + r0 * words);
    });
    return;
  }
#endif
#if TAPEHOOK_HAVE_AVX2_PATH
  if (cpu::Avx2()) {
    parallel_for(rows, channels / 4 + 1, [&](int64_t r0, int64_t r1) {
      PackRows256(x + r0 * channels, r1 - r0, channels, out + r0 * words);
    });
    return;
  }
#endif
  PackRows(x, rows, channels, out, parallel_for,
           [](float v) { return v < 0.0f; });
}

void PackSignsInt8(const int8_t* x, int64_t rows, int64_t channels,
                   int32_t zero_point, int32_t* out,
                   const ParallelFor& parallel_for) {
  PackRows(x, rows, channels, out, parallel_for,
           [zero_point](int8_t v) { return int32_t{v} < zero_point; });
}

void UnpackSigns(const int32_t* in, int64_t rows, int64_t channels, float* out,
                 const ParallelFor& parallel_for) {
  UnpackRows(in, rows, channels, 1.0f, -1.0f, out, parallel_for);
}

void UnpackSignsInt8(const int32_t* in, int64_t rows, int64_t channels,
                     int8_t zero_bit, int8_t one_bit, int8_t* out,
                     const ParallelFor& parallel_for) {
  UnpackRows(in, rows, channels, zero_bit, one_bit, out, parallel_for);
}

// Each group is one core conv of in_c = channels_in / groups over its own
// words of the input; one-padding is written into the input (0 bits), so
// the core sees VALID, and zero padding is the core's own.
struct BConv2D::State {
  BConvAttrs attrs;
  OutputKind kind = OutputKind::kFloat;
  int64_t groups = 1, in_words = 0, group_words = 0;
  int64_t out_c = 0, out_h = 0, out_w = 0;
  int64_t raw_h = 0, raw_w = 0;  // the input tensor's height and width
  int64_t pad_top = 0, pad_left = 0;
  bool one_pad = false;
  int32_t K = 0;  // k_h * k_w * channels per group
  ConvShape s;    // one group's conv, as the core runs it
  Impl impl = Impl::kPortable;
  std::vector<BitFilter<float>> filters;  // per group
  std::vector<float> multiplier, bias;    // LCE's output transform
  int32_t clamp_min = 0, clamp_max = 0;
  std::vector<int32_t> thresholds;
  // Scratch, sized at Prepare.
  // The group's input as the core's tier reads it: 64 channels to a word,
  // on the AVX2 tier in their nibble form (TierPixelWords).
  std::vector<uint64_t> xb;
  std::vector<float> dots;  // [pixels][out_c / groups], unless in place
};

BConv2D::BConv2D() : state_(new State) {}
BConv2D::~BConv2D() = default;

int64_t BConv2D::out_h() const { return state_->out_h; }
int64_t BConv2D::out_w() const { return state_->out_w; }
int64_t BConv2D::out_channels() const {
  return state_->kind == OutputKind::kBitpacked ? PackedWords(state_->out_c)
                                                : state_->out_c;
}
const char* BConv2D::impl_name() const { return ImplName(state_->impl); }

std::string BConv2D::Prepare(const BConvAttrs& attrs, OutputKind kind,
                             int64_t batch, int64_t in_h, int64_t in_w,
                             int64_t in_words, const int64_t filter_dims[4],
                             const int32_t* filter, const float* post_mul,
                             const float* post_bias, const int32_t* thresholds,
                             double output_scale, int32_t output_zero_point) {
  State& st = *state_;
  st = State();
  st.attrs = attrs;
  st.kind = kind;
  const int64_t C = attrs.channels_in;
  const int64_t N = filter_dims[0];
  if (C < 1) return "channels_in must be >= 1";
  if (in_words != PackedWords(C)) {
    return "the input has " + std::to_string(in_words) +
           " words per pixel, but channels_in " + std::to_string(C) +
           " packs into " + std::to_string(PackedWords(C));
  }
  if (N < 1 || filter_dims[1] < 1 || filter_dims[2] < 1 || filter_dims[3] < 1) {
    return "the filter has an empty dimension";
  }
  if (attrs.pad_value != 0 && attrs.pad_value != 1) {
    return "pad_values must be 0 or 1";
  }
  if (in_words % filter_dims[3] != 0) {
    return "the filter's " + std::to_string(filter_dims[3]) +
           " words per pixel do not divide the input's " +
           std::to_string(in_words);
  }
  st.groups = filter_dims[3] == in_words ? 1 : in_words / filter_dims[3];
  if (st.groups > 1 &&
      (C % st.groups != 0 || (C / st.groups) % 32 != 0 || N % st.groups != 0)) {
    return "grouped bconv needs channels_in / groups a multiple of 32 and "
           "output channels a multiple of groups";
  }
  const bool zero_pad = attrs.same && attrs.pad_value == 0;
  if (zero_pad &&
      (kind != OutputKind::kFloat || attrs.activation != Activation::kNone)) {
    return "zero padding (pad_values 0 with SAME) is supported with float "
           "output and no fused activation only, as in LCE's optimized "
           "kernels";
  }
  st.in_words = in_words;
  st.group_words = filter_dims[3];
  st.out_c = N;
  const int64_t Cg = C / st.groups, Ng = N / st.groups;
  st.K = static_cast<int32_t>(filter_dims[1] * filter_dims[2] * Cg);

  ConvShape s;
  s.batch = batch, s.in_h = in_h, s.in_w = in_w, s.in_c = Cg;
  s.k_h = filter_dims[1], s.k_w = filter_dims[2], s.out_c = Ng;
  s.stride_h = attrs.stride_h, s.stride_w = attrs.stride_w;
  s.dil_h = attrs.dil_h, s.dil_w = attrs.dil_w;
  std::string error = ComputeConvGeometry(
      attrs.same ? Padding::kSame : Padding::kValid, 0, 0, 0, 0, &s);
  if (!error.empty()) return error;
  st.out_h = s.out_h, st.out_w = s.out_w;
  st.pad_top = s.pad_top, st.pad_left = s.pad_left;
  st.one_pad = attrs.same && attrs.pad_value == 1;
  if (st.one_pad) {
    // The padded input holds SAME's padding on all four sides; the conv is
    // then VALID over it, with the same output size.
    const int64_t ek_h = (s.k_h - 1) * s.dil_h + 1;
    const int64_t ek_w = (s.k_w - 1) * s.dil_w + 1;
    s.in_h = std::max(in_h, (s.out_h - 1) * s.stride_h + ek_h);
    s.in_w = std::max(in_w, (s.out_w - 1) * s.stride_w + ek_w);
    s.pad_top = 0, s.pad_left = 0;
  }
  st.raw_h = in_h, st.raw_w = in_w;
  st.s = s;
  st.impl = RunnableOrBest(QueryOf(ConvOp::kForward, s, true, false, false),
                           Impl::kBest);
  const BitIsa isa = BitIsaOf(st.impl);

  // The filter, per group, in the core's layout: W's words
  // [tap * cw + k][n_pad], each tap's popcount, alpha 1 (the dot itself).
  const int64_t taps = s.k_h * s.k_w, cw = WordsPerPixel(s);
  const int64_t fw = filter_dims[3];
  for (int64_t g = 0; g < st.groups; ++g) {
    BitFilter<float> f;
    f.k_h = s.k_h, f.k_w = s.k_w, f.in_c = Cg, f.out_c = Ng;
    f.scale = Scale::kNone;
    f.isa = static_cast<int>(isa);
    f.n_pad = RoundUp(Ng, kPopColTile);
    f.words.assign(taps * cw * f.n_pad, 0);
    f.tap_count.assign(taps * Ng, 0);
    for (int64_t o = 0; o < Ng; ++o) {
      const int32_t* wo = filter + (g * Ng + o) * taps * fw;
      for (int64_t t = 0; t < taps; ++t) {
        for (int64_t k = 0; k < cw; ++k) {
          const uint64_t lo = static_cast<uint32_t>(wo[t * fw + 2 * k]);
          const uint64_t hi =
              2 * k + 1 < fw ? static_cast<uint32_t>(wo[t * fw + 2 * k + 1])
                             : 0;
          const uint64_t word = lo | hi << 32;
          f.words[(t * cw + k) * f.n_pad + o] = word;
          f.tap_count[t * Ng + o] += __builtin_popcountll(word);
        }
      }
    }
    if (isa == BitIsa::kAvx2) {
      f.nibbles = NibblePanels(f.words, taps * cw, f.n_pad);
      f.words = std::vector<uint64_t>();
    }
    f.alpha.assign(Ng, 1.0f);
    st.filters.push_back(std::move(f));
  }

  if (kind == OutputKind::kBitpacked) {
    st.thresholds.assign(thresholds, thresholds + N);
  } else {
    // LCE's OneTimeSetup, in the same precision and order.
    const double scale = kind == OutputKind::kInt8 ? output_scale : 1.0;
    const double zero = kind == OutputKind::kInt8 ? output_zero_point : 0.0;
    st.multiplier.resize(N);
    st.bias.resize(N);
    for (int64_t o = 0; o < N; ++o) {
      const double m = post_mul[o], b = post_bias[o];
      st.multiplier[o] = static_cast<float>(-1 * m / scale);
      st.bias[o] = static_cast<float>(
          (b + static_cast<double>(st.K) * m) / scale + zero);
    }
    int32_t lo, hi;
    ActivationRange(attrs.activation, &lo, &hi);
    lo = std::max(lo, -st.K);
    hi = std::min(hi, st.K);
    st.clamp_min = -hi + st.K;
    st.clamp_max = -lo + st.K;
  }

  st.xb.assign(batch * s.in_h * s.in_w * TierPixelWords(isa, s), 0);
  if (!(kind == OutputKind::kFloat && st.groups == 1)) {
    st.dots.assign(OutPixels(s) * Ng, 0.0f);
  }
  return "";
}

void BConv2D::Run(const int32_t* input, void* output,
                  const ParallelFor& parallel_for,
                  const std::vector<EpilogueStep>* steps) {
  State& st = *state_;
  const ConvShape& s = st.s;
  const int64_t pixels = OutPixels(s);
  if (pixels == 0) return;
  const int64_t Ng = s.out_c, N = st.out_c, Cg = s.in_c;
  const int64_t cw = WordsPerPixel(s), gw = st.group_words;
  const BitIsa isa = static_cast<BitIsa>(st.filters[0].isa);
  const int64_t pw = TierPixelWords(isa, s);
  const int64_t top = st.one_pad ? st.pad_top : 0;
  const int64_t left = st.one_pad ? st.pad_left : 0;
  const bool in_place = st.kind == OutputKind::kFloat && st.groups == 1;
  if (st.kind == OutputKind::kBitpacked) {
    std::fill_n(static_cast<int32_t*>(output), pixels * PackedWords(N), 0);
  }
  for (int64_t g = 0; g < st.groups; ++g) {
    // The group's input in the core's form, straight from LCE's words (the
    // same bits: 1 where negative); one-padding taps read +1 (0 bits).
    parallel_for(
        s.batch * s.in_h, s.in_w * (Cg + 1), [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r) {
            const int64_t n = r / s.in_h, ih = r % s.in_h - top;
            for (int64_t col = 0; col < s.in_w; ++col) {
              const int64_t iw = col - left;
              const bool inside =
                  ih >= 0 && ih < st.raw_h && iw >= 0 && iw < st.raw_w;
              const int32_t* src =
                  input + ((n * st.raw_h + ih) * st.raw_w + iw) * st.in_words +
                  g * gw;
              uint64_t* xb = &st.xb[(r * s.in_w + col) * pw];
              for (int64_t k = 0; k < cw; ++k) {
                uint64_t word = 0;
                if (inside) {
                  word = static_cast<uint32_t>(src[2 * k]);
                  if (2 * k + 1 < gw) {
                    word |= uint64_t{static_cast<uint32_t>(src[2 * k + 1])}
                            << 32;
                  }
                }
                if (isa == BitIsa::kAvx2) {
                  xb[2 * k] = LowNibbles(word);
                  xb[2 * k + 1] = HighNibbles(word);
                } else {
                  xb[k] = word;
                }
              }
            }
          }
        });
    const BitFilter<float>& f = st.filters[g];
    float* dots = in_place ? static_cast<float*>(output) : st.dots.data();
#if TAPEHOOK_HAVE_AVX512_PATH
    if (isa == BitIsa::kAvx512) {
      // x is read only for prefetching, which a packed input does not do.
      static const float kNoFloats[1] = {0.0f};
      BitpackedBlocks512<float>(s, BitInput::kPacked, kNoFloats, st.xb.data(),
                                f.words.data(), f.n_pad, f.tap_count.data(),
                                f.alpha.data(), dots, parallel_for, nullptr,
                                false, nullptr);
    } else
#endif
    {
      BitpackedBlocks<float>(s, st.xb.data(), f, dots, parallel_for,
                             f.alpha.data(), nullptr, false, nullptr);
    }
    // LCE's output transform of 2 * count = K - dot, a row of Ng outputs at
    // a time by the branch-free loops above (the output kind is fixed).
    const float* mult = st.multiplier.data() + g * Ng;
    const float* bias = st.bias.data() + g * Ng;
    const float k = static_cast<float>(st.K);
    const float lo = static_cast<float>(st.clamp_min);
    const float hi = static_cast<float>(st.clamp_max);
    // Epilogue steps run on a few rows at a time, while they are in L1.
    constexpr int64_t kStepRows = 16;
    parallel_for(pixels, 4 * Ng + 1, [&](int64_t p0, int64_t p1) {
      for (int64_t c0 = p0; c0 < p1; c0 += kStepRows) {
        const int64_t c1 = std::min(p1, c0 + kStepRows);
        for (int64_t p = c0; p < c1; ++p) {
          const float* row = dots + p * Ng;
          if (st.kind == OutputKind::kBitpacked) {
            BitpackedOutputs(row, Ng, st.K, st.thresholds.data() + g * Ng,
                             static_cast<int32_t*>(output) + p * PackedWords(N),
                             g * Ng);
          } else if (st.kind == OutputKind::kFloat) {
            FloatOutputs(row, Ng, k, lo, hi, mult, bias,
                         float_out(output) + p * N + g * Ng);
          } else {
            Int8Outputs(row, Ng, k, lo, hi, mult, bias,
                        static_cast<int8_t*>(output) + p * N + g * Ng);
          }
        }
        if (steps != nullptr && st.kind == OutputKind::kFloat) {
          ApplySteps(*steps, c0, c1 - c0, N, g * Ng, Ng,
                     float_out(output) + c0 * N + g * Ng);
        }
      }
    });
  }
}

std::string BMaxPoolGeometry(int64_t in_h, int64_t in_w, int64_t k_h,
                             int64_t k_w, int64_t stride_h, int64_t stride_w,
                             bool same, int64_t* out_h, int64_t* out_w) {
  ConvShape s;
  s.batch = 1, s.in_h = in_h, s.in_w = in_w, s.in_c = 1;
  s.k_h = k_h, s.k_w = k_w, s.out_c = 1;
  s.stride_h = stride_h, s.stride_w = stride_w;
  std::string error = ComputeConvGeometry(
      same ? Padding::kSame : Padding::kValid, 0, 0, 0, 0, &s);
  *out_h = s.out_h, *out_w = s.out_w;
  return error;
}

void BMaxPool(const int32_t* input, int64_t batch, int64_t in_h, int64_t in_w,
              int64_t words, int64_t k_h, int64_t k_w, int64_t stride_h,
              int64_t stride_w, bool same, int32_t* output,
              const ParallelFor& parallel_for) {
  ConvShape s;
  s.batch = batch, s.in_h = in_h, s.in_w = in_w, s.in_c = 1;
  s.k_h = k_h, s.k_w = k_w, s.out_c = 1;
  s.stride_h = stride_h, s.stride_w = stride_w;
  if (!ComputeConvGeometry(same ? Padding::kSame : Padding::kValid, 0, 0, 0, 0,
                           &s)
           .empty()) {
    return;
  }
  parallel_for(OutPixels(s), k_h * k_w * words + 1,
               [&](int64_t p0, int64_t p1) {
                 for (int64_t p = p0; p < p1; ++p) {
                   const PixelPos q = Pos(s, p);
                   const int64_t h0 = q.oh * stride_h - s.pad_top;
                   const int64_t w0 = q.ow * stride_w - s.pad_left;
                   int32_t* out = output + p * words;
                   std::fill_n(out, words, ~int32_t{0});
                   for (int64_t ih = std::max<int64_t>(h0, 0);
                        ih < std::min(h0 + k_h, in_h); ++ih) {
                     for (int64_t iw = std::max<int64_t>(w0, 0);
                          iw < std::min(w0 + k_w, in_w); ++iw) {
                       const int32_t* in =
                           input + ((q.n * in_h + ih) * in_w + iw) * words;
                       for (int64_t k = 0; k < words; ++k) out[k] &= in[k];
                     }
                   }
                 }
               });
}

}  // namespace lce
}  // namespace tapehook
