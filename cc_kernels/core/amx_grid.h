// The q grid of the AMX kernels (see amx_conv.cc's file comment): a padded
// input flattened row-major, where every tap of every output pixel is one
// fixed row offset away.
#ifndef TAPEHOOK_CORE_AMX_GRID_H_
#define TAPEHOOK_CORE_AMX_GRID_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "geometry.h"

namespace tapehook {
namespace amx {

// The padded input of a stride-1 conv as a q grid (see the file comment).
struct Grid {
  int64_t batch, hp, wp;
  int64_t top, left;     // zero rows / columns before the data
  int64_t rows, cols;    // data size (in_h, in_w of what is padded)
  int64_t out_h, out_w;  // the output pixels that live on the grid
  int64_t plane() const { return hp * wp; }
  // One past the last output pixel's q.
  int64_t q_end() const {
    return (batch - 1) * plane() + (out_h - 1) * wp + out_w;
  }
  // Data pixel index (n * rows + r) * cols + c of grid row q, or -1 when q
  // is padding.
  int64_t DataPixel(int64_t q) const {
    const int64_t n = q / plane(), rem = q % plane();
    const int64_t r = rem / wp - top, c = rem % wp - left;
    if (n >= batch || r < 0 || r >= rows || c < 0 || c >= cols) return -1;
    return (n * rows + r) * cols + c;
  }
  // f(i, DataPixel(q0 + i)) (data) or f(i, OutPixel(q0 + i)) for i < n,
  // without a division per row.
  template <typename F>
  void Walk(int64_t q0, int64_t n, bool data, F f) const {
    WalkCoords(q0, n, data, [&](int64_t i, int64_t img, int64_t r, int64_t c) {
      f(i, img < 0 ? -1
           : data  ? (img * rows + r) * cols + c
                   : (img * out_h + r) * out_w + c);
    });
  }
  // The same with the pixel as f(i, image, row, column) of the data (or
  // output) image; image = -1 where there is none.
  template <typename F>
  void WalkCoords(int64_t q0, int64_t n, bool data, F f) const {
    int64_t img = q0 / plane(), row = q0 % plane() / wp, col = q0 % wp;
    for (int64_t i = 0; i < n; ++i) {
      if (data) {
        const int64_t r = row - top, c = col - left;
        const bool in = img < batch && r >= 0 && r < rows && c >= 0 && c < cols;
        f(i, in ? img : -1, r, c);
      } else {
        const bool in = img < batch && row < out_h && col < out_w;
        f(i, in ? img : -1, row, col);
      }
      if (++col == wp) {
        col = 0;
        if (++row == hp) row = 0, ++img;
      }
    }
  }
  // Output pixel index of q, or -1 when q is not an output pixel.
  int64_t OutPixel(int64_t q) const {
    const int64_t n = q / plane(), rem = q % plane();
    const int64_t r = rem / wp, c = rem % wp;
    if (n >= batch || r >= out_h || c >= out_w) return -1;
    return (n * out_h + r) * out_w + c;
  }
};

struct Taps {
  std::vector<int64_t> off;  // grid row offset of each tap
  int64_t max_off = 0;
};

inline Taps TapOffsets(const ConvShape& s, int64_t wp) {
  Taps t;
  for (int64_t kh = 0; kh < s.k_h; ++kh) {
    for (int64_t kw = 0; kw < s.k_w; ++kw) {
      t.off.push_back(kh * s.dil_h * wp + kw * s.dil_w);
    }
  }
  t.max_off = t.off.back();
  return t;
}

// A q grid for data of rows x cols pixels padded by (top, left) and read
// by a stride-1 conv with taps spanning (eh, ew) to give out_h x out_w
// outputs. Neighbours share their zero padding: a row's right padding is the
// next row's left padding, an image's bottom padding the next image's top
// padding. A tap past the right edge of a grid row lands in the next grid
// row's first ew - (wp - out_w) < left columns, which are padding; likewise a
// tap below an image lands in the next image's top rows. So wp = cols +
// max(left, right padding) and hp = rows + max(top, bottom padding) (at
// least the outputs' size, for padding wider than the taps): at
// 7x7 with a 3x3 SAME conv 8x8 = 64 grid rows per image instead of 9x9 = 81,
// and every grid row is a GEMM row the AMX kernels compute.
inline Grid PaddedGrid(int64_t batch, int64_t top, int64_t left, int64_t rows,
                       int64_t cols, int64_t out_h, int64_t out_w, int64_t eh,
                       int64_t ew) {
  Grid g;
  g.batch = batch;
  g.top = top;
  g.left = left;
  g.rows = rows;
  g.cols = cols;
  g.out_h = out_h;
  g.out_w = out_w;
  g.hp = std::max({top + rows, out_h + eh - top, out_h});
  g.wp = std::max({left + cols, out_w + ew - left, out_w});
  return g;
}

// The grid of a stride-1 forward conv's padded input.
inline Grid InputGrid(const ConvShape& s) {
  return PaddedGrid(s.batch, s.pad_top, s.pad_left, s.in_h, s.in_w, s.out_h,
                    s.out_w, (s.k_h - 1) * s.dil_h, (s.k_w - 1) * s.dil_w);
}

}  // namespace amx
}  // namespace tapehook

#endif  // TAPEHOOK_CORE_AMX_GRID_H_
