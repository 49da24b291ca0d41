// The float-operand kernels without AMX (binary_conv.cc): one small
// register-blocked GEMM, fed by im2col blocks (forward, dW) or by dY rows
// gathered per tap (dX by taps). Plain portable C++17, the inner
// loops written so that -O3 vectorizes them without any -march flags; the
// AVX2 tiles (simd_avx2.h) where the plan says kAvx2.
#ifndef TAPEHOOK_CORE_FLOAT_GEMM_H_
#define TAPEHOOK_CORE_FLOAT_GEMM_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "conv_util.h"
#include "geometry.h"
#include "plan.h"
#include "simd_avx2.h"

namespace tapehook {

// Output pixels per im2col block: a [P, K] block stays in L2; a multiple
// of both GEMM tiles' row counts (4 and 6).
constexpr int64_t kPixelBlock = 48;
// BackpropFilter's GEMM has depth = pixels; longer blocks amortize the loads
// and stores of its accumulator (the unit's rows of dW).
constexpr int64_t kFilterPixelBlock = 256;
// Depth of one GEMM pass, so the panels of A and B a tile reads stay in L1.
constexpr int64_t kDepthBlock = 128;
// Columns of B per pass: a [kDepthBlock, kColumnBlock] slice is 128 KiB.
constexpr int64_t kColumnBlock = 256;
// Input channels per BackpropFilter work unit (one tap times this many
// channels are the unit's rows of dW).
constexpr int64_t kFilterChannelBlock = 64;

// Portable register tile of the GEMM: kMR rows by kNR columns of C, kNR
// being two 128-bit vectors (SSE2 is all that the portable build may assume).
template <typename T>
struct GemmTile {
  static constexpr int kMR = 4;
  static constexpr int kNR = 32 / sizeof(T);
};

// c[i, j] (+)= sum_k A(i, k) * b[k, j] for one tile, A a PanelA or RowsA
// (simd_avx2.h). With kFullN the tile is NR wide, its loops unroll fully and
// acc lives in registers. Rows >= mr of A are zeros and are computed but not
// stored.
template <typename T, int MR, int NR, bool kFullN, typename A>
inline void GemmTileKernel(int64_t depth, const A& a, const T* b, int64_t ldb,
                           T* c, int64_t ldc, bool accumulate, int mr, int nr) {
  const int n = kFullN ? NR : nr;
  T acc[MR][NR] = {};
  if (accumulate) {
    for (int i = 0; i < mr; ++i) {
      for (int j = 0; j < n; ++j) acc[i][j] = c[i * ldc + j];
    }
  }
  for (int64_t k = 0; k < depth; ++k) {
    const T* bk = b + k * ldb;
    for (int i = 0; i < MR; ++i) {
      const T ai = *a.At(i, k);
      for (int j = 0; j < n; ++j) acc[i][j] += ai * bk[j];
    }
  }
  for (int i = 0; i < mr; ++i) {
    for (int j = 0; j < n; ++j) c[i * ldc + j] = acc[i][j];
  }
}

// Column width of the GEMM's register tile on the plan's tier (the AVX2
// tiles for every tier above portable: kAmx plans get here only for work the
// AMX kernels leave, and cpu.h grants AMX only with AVX2).
template <typename T>
int GemmNR(Impl impl) {
#if TAPEHOOK_HAVE_AVX2_PATH
  if (impl != Impl::kPortable) return simd::GemmNR<T>();
#endif
  return GemmTile<T>::kNR;
}

// B[depth, n] (read through strides) packed as ceil(n / nr) panels of
// [depth][nr], zero-padded past n: the tile kernel then streams contiguous
// memory (rows of B a power-of-two apart would otherwise fall into a few L1
// sets). Weights and dY are packed once per kernel call.
template <typename T>
struct PackedB {
  int64_t depth = 0, n = 0, nr = 0;
  std::vector<T> data;
};

// Rows [k_begin, k_begin + depth) of a PackedB: the B of one GEMM.
template <typename T>
struct PackedRows {
  const PackedB<T>* b;
  int64_t k_begin, depth;
  int64_t n() const { return b->n; }
  int64_t nr() const { return b->nr; }
  const T* Panel(int64_t j0, int64_t k0) const {  // j0: a multiple of nr
    return b->data.data() + j0 * b->depth + (k_begin + k0) * b->nr;
  }
};

template <typename T>
PackedRows<T> AllRows(const PackedB<T>& b) {
  return {&b, 0, b.depth};
}

// Packs B[depth, n], element (k, j) being at(k, j), into out (depth, n and
// the ISA's tile width), by parallel_for over panels.
template <typename T, typename At>
void PackBWith(int64_t depth, int64_t n, const At& at, Impl impl,
               const ParallelFor& parallel_for, PackedB<T>* out) {
  const int64_t nr = GemmNR<T>(impl);
  out->depth = depth;
  out->n = n;
  out->nr = nr;
  out->data.resize(RoundUp(n, nr) * depth);
  parallel_for(RoundUp(n, nr) / nr, depth * nr, [&](int64_t p0, int64_t p1) {
    for (int64_t j0 = p0 * nr; j0 < p1 * nr; j0 += nr) {
      const int64_t cols = std::min(nr, n - j0);
      T* dst = out->data.data() + j0 * depth;
      for (int64_t k = 0; k < depth; ++k) {
        for (int64_t j = 0; j < nr; ++j) {
          dst[k * nr + j] = j < cols ? at(k, j0 + j) : T(0);
        }
      }
    }
  });
}

// PackBWith of B read through strides.
template <typename T>
void PackB(int64_t depth, int64_t n, const T* b, int64_t b_rs, int64_t b_cs,
           Impl impl, const ParallelFor& parallel_for, PackedB<T>* out) {
  PackBWith(
      depth, n, [&](int64_t k, int64_t j) { return b[k * b_rs + j * b_cs]; },
      impl, parallel_for, out);
}

// A read through strides, so col*W, dY*W^T and col^T*dY all use one
// GEMM: Pack writes rows [i0, i0 + mr) and depth [k0, k0 + kc) of A as a
// [kc][MR] panel, rows >= mr as zeros.
template <typename T>
struct StridedA {
  static constexpr bool kInPlace = false;
  const T* a;
  int64_t a_rs, a_cs;
  void Pack(int64_t /*segment*/, int64_t i0, int mr, int MR, int64_t k0,
            int64_t kc, T* panel) const {
    const T* at = a + i0 * a_rs + k0 * a_cs;
    if (a_rs == 1 && mr == MR) {  // col^T of BackpropFilter: runs of MR
      for (int64_t k = 0; k < kc; ++k) {
        std::copy_n(at + k * a_cs, MR, panel + k * MR);
      }
      return;
    }
    for (int64_t k = 0; k < kc; ++k) {
      for (int i = 0; i < MR; ++i) {
        panel[k * MR + i] = i < mr ? at[i * a_rs + k * a_cs] : T(0);
      }
    }
  }
};

// An A whose row i in depth segment s is the contiguous run rows[s * m + i]
// (nullptr: zeros), read in place (RowsA): the gathered dY rows of
// BackpropInput by taps, which would cost as much to pack as to multiply
// where C is narrow.
template <typename T>
struct GatheredA {
  static constexpr bool kInPlace = true;
  const T* const* rows;
  int64_t m;
  template <int MR>
  RowsA<T, MR> Rows(int64_t segment, int64_t i0, int mr, int64_t k0) const {
    static const T kZeros[kDepthBlock] = {};
    RowsA<T, MR> out;
    for (int i = 0; i < MR; ++i) {
      const T* row = i < mr ? rows[segment * m + i0 + i] : nullptr;
      out.rows[i] = row == nullptr ? kZeros : row + k0;
    }
    return out;
  }
};

// C[m, n] (+)= sum over segments s of A_s[m, depth_s] * B_s[depth_s, n],
// B_s = b[s] (all n columns wide), with an MR x NR register tile; full
// tiles go to full_tile (portable or AVX2), the ragged right edge to the
// portable kernel. C is row-major; a_src packs A's panels ([depth][MR], so
// the tile kernel vectorizes across columns, not depth) or, kInPlace, hands
// the tile its MR rows to read where they are. Columns are
// blocked so the B panels that all row panels reuse stay in L2, and column
// blocks are the outer loop so a block's C tiles stay in cache over the
// segments and depth passes (each C element still sums them in order).
template <typename T, int MR, int NR, typename ASource, typename FullTile>
void GemmBlocked(int64_t m, int64_t segments, const PackedRows<T>* b,
                 const ASource& a_src, T* c, int64_t ldc, bool accumulate,
                 FullTile full_tile) {
  T a_panel[kDepthBlock * MR];
  const int64_t n = b[0].n();
  for (int64_t jb = 0; jb < n; jb += kColumnBlock) {
    const int64_t jb_end = std::min(n, jb + kColumnBlock);
    for (int64_t seg = 0; seg < segments; ++seg) {
      for (int64_t k0 = 0; k0 < b[seg].depth; k0 += kDepthBlock) {
        const int64_t kc = std::min(kDepthBlock, b[seg].depth - k0);
        const bool acc = accumulate || seg > 0 || k0 > 0;
        for (int64_t i0 = 0; i0 < m; i0 += MR) {
          const int mr = static_cast<int>(std::min<int64_t>(MR, m - i0));
          const auto a = [&] {
            if constexpr (ASource::kInPlace) {
              return a_src.template Rows<MR>(seg, i0, mr, k0);
            } else {
              a_src.Pack(seg, i0, mr, MR, k0, kc, a_panel);
              return PanelA<T, MR>{a_panel};
            }
          }();
          for (int64_t j0 = jb; j0 < jb_end; j0 += NR) {
            const int nr = static_cast<int>(std::min<int64_t>(NR, jb_end - j0));
            T* ct = c + i0 * ldc + j0;
            if (nr == NR) {
              full_tile(kc, a, b[seg].Panel(j0, k0), NR, ct, ldc, acc, mr);
            } else {
              GemmTileKernel<T, MR, NR, false>(kc, a, b[seg].Panel(j0, k0), NR,
                                               ct, ldc, acc, mr, nr);
            }
          }
        }
      }
    }
  }
}

// GemmBlocked on the tile kernels of the tier PackB chose.
template <typename T, typename ASource>
void GemmSegments(int64_t m, int64_t segments, const PackedRows<T>* b,
                  const ASource& a_src, T* c, int64_t ldc, bool accumulate) {
#if TAPEHOOK_HAVE_AVX2_PATH
  if (b[0].nr() == simd::GemmNR<T>()) {
    GemmBlocked<T, simd::kGemmMR, simd::GemmNR<T>()>(
        m, segments, b, a_src, c, ldc, accumulate,
        [](int64_t kc, const auto& a, const T* bt, int64_t ldb, T* ct,
           int64_t ldc_, bool acc,
           int mr) { simd::GemmTileWith(kc, a, bt, ldb, ct, ldc_, acc, mr); });
    return;
  }
#endif
  constexpr int MR = GemmTile<T>::kMR, NR = GemmTile<T>::kNR;
  GemmBlocked<T, MR, NR>(m, segments, b, a_src, c, ldc, accumulate,
                         [](int64_t kc, const auto& a, const T* bt, int64_t ldb,
                            T* ct, int64_t ldc_, bool acc, int mr) {
                           GemmTileKernel<T, MR, NR, true>(kc, a, bt, ldb, ct,
                                                           ldc_, acc, mr, NR);
                         });
}

template <typename T>
void Gemm(int64_t m, const T* a, int64_t a_rs, int64_t a_cs,
          const PackedRows<T>& b, T* c, int64_t ldc, bool accumulate) {
  GemmSegments(m, 1, &b, StridedA<T>{a, a_rs, a_cs}, c, ldc, accumulate);
}

// W_hat = alpha * sign(W) packed for a GEMM: as the [K, out_c] matrix of
// the forward (HWIO flattened), or by tap, [taps * out_c, in_c] (row
// tap * out_c + o), the B of BackpropInput by taps.
enum class WeightLayout { kFilter, kByTap };

template <typename T>
PackedB<T> PackedSignedWeights(const ConvShape& s, const T* w, Scale scale,
                               WeightLayout layout, Impl impl,
                               const ParallelFor& parallel_for) {
  const int64_t K = FilterSize(s);
  const int64_t N = s.out_c, C = s.in_c;
  const std::vector<T> alpha = [&] {
    const std::vector<double> a = Alpha(s, w, scale);
    return std::vector<T>(a.begin(), a.end());
  }();
  PackedB<T> packed;
  if (layout == WeightLayout::kFilter) {
    PackBWith<T>(
        K, N,
        [&](int64_t k, int64_t o) { return alpha[o] * Sign(w[k * N + o]); },
        impl, parallel_for, &packed);
  } else {  // row tap * N + o, column c: w[(tap * C + c) * N + o]
    // Each unit (a panel of nr input channels, one tap) reads its nr rows
    // of W contiguously: read column-wise instead, as PackBWith would, the
    // rows are N floats apart and a power of two of them falls into a few
    // L1 sets, which made the packing a large part of a small-image dX.
    const int64_t taps = K / C, nr = GemmNR<T>(impl), depth = taps * N;
    packed.depth = depth;
    packed.n = C;
    packed.nr = nr;
    packed.data.assign(RoundUp(C, nr) * depth, T(0));
    parallel_for(RoundUp(C, nr) / nr * taps, N * nr,
                 [&](int64_t u0, int64_t u1) {
                   for (int64_t u = u0; u < u1; ++u) {
                     const int64_t j0 = u / taps * nr, tap = u % taps;
                     T* dst = packed.data.data() + j0 * depth + tap * N * nr;
                     for (int64_t j = 0; j < std::min(nr, C - j0); ++j) {
                       const T* src = w + (tap * C + j0 + j) * N;
                       for (int64_t o = 0; o < N; ++o) {
                         dst[o * nr + j] = alpha[o] * Sign(src[o]);
                       }
                     }
                   }
                 });
  }
  return packed;
}

// Row p of col [np, (tap1 - tap0) * (c1 - c0)] holds input channels
// [c0, c1) of kernel taps [tap0, tap1) (tap = kh * k_w + kw) of the
// receptive field of output pixel pix0 + p, laid out like the K axis of an
// HWIO filter. Taps in the padding are 0 (not sign(0)); x_hat = sign(x)
// when binary.
template <typename T>
void Im2Col(const ConvShape& s, const T* x, bool binary, int64_t pix0,
            int64_t np, int64_t tap0, int64_t tap1, int64_t c0, int64_t c1,
            T* col) {
  const int64_t C = s.in_c, width = c1 - c0;
  for (int64_t p = 0; p < np; ++p) {
    const PixelPos q = Pos(s, pix0 + p);
    const T* xn = x + q.n * s.in_h * s.in_w * C + c0;
    T* dst = col + p * (tap1 - tap0) * width;
    for (int64_t tap = tap0; tap < tap1; ++tap, dst += width) {
      const int64_t ih = q.oh * s.stride_h - s.pad_top + tap / s.k_w * s.dil_h;
      const int64_t iw = q.ow * s.stride_w - s.pad_left + tap % s.k_w * s.dil_w;
      if (ih < 0 || ih >= s.in_h || iw < 0 || iw >= s.in_w) {
        std::fill(dst, dst + width, T(0));
        continue;
      }
      const T* src = xn + (ih * s.in_w + iw) * C;
      if (binary) {
        for (int64_t c = 0; c < width; ++c) dst[c] = Sign(src[c]);
      } else {
        std::copy(src, src + width, dst);
      }
    }
  }
}

}  // namespace tapehook

#endif  // TAPEHOOK_CORE_FLOAT_GEMM_H_
