// Packed input of a binary-activation conv: what its backward needs from x.
//
// Per element, 2 bits: sign (x >= 0) and the ste_sign mask (|x| <= clip).
// Rows are the leading axes, channels the last axis; row r, channel c lives in
// byte r * PackedBytes(channels) + c / 4, sign bit 7 - 2 (c % 4), mask bit
// 6 - 2 (c % 4). 16x smaller than float32.
#ifndef TAPEHOOK_CORE_PACK_INPUT_H_
#define TAPEHOOK_CORE_PACK_INPUT_H_

#include <cstdint>

#include "binary_conv.h"

namespace tapehook {

inline int64_t PackedBytes(int64_t channels) { return (channels + 3) / 4; }

template <typename T>
void PackSignMask(const T* x, int64_t rows, int64_t channels, double clip,
                  uint8_t* packed, const ParallelFor& parallel_for);

// x_hat = +-1 from the sign bits, mask = 0 / 1.
template <typename T>
void UnpackSignMask(const uint8_t* packed, int64_t rows, int64_t channels,
                    T* x_hat, T* mask, const ParallelFor& parallel_for);

}  // namespace tapehook

#endif  // TAPEHOOK_CORE_PACK_INPUT_H_
