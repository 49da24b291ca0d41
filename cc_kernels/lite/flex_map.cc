#include "flex_map.h"

#include <cmath>
#include <cstring>

namespace tapehook {
namespace lite {

namespace {

// FlexBuffers value types used here.
enum : int {
  kNull = 0,
  kInt = 1,
  kUInt = 2,
  kFloat = 3,
  kIndirectInt = 6,
  kIndirectUInt = 7,
  kIndirectFloat = 8,
  kMap = 9,
  kBool = 26,
};

class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  bool Has(size_t at, size_t bytes) const {
    return at <= size_ && bytes <= size_ - at;
  }
  // Unsigned little-endian integer of `width` bytes at `at`.
  bool UInt(size_t at, int width, uint64_t* out) const {
    if (!(width == 1 || width == 2 || width == 4 || width == 8)) return false;
    if (!Has(at, width)) return false;
    uint64_t v = 0;
    for (int i = width - 1; i >= 0; --i) v = v << 8 | data_[at + i];
    *out = v;
    return true;
  }
  bool Int(size_t at, int width, int64_t* out) const {
    uint64_t u;
    if (!UInt(at, width, &u)) return false;
    const int shift = 64 - 8 * width;
    *out = static_cast<int64_t>(u << shift) >> shift;
    return true;
  }
  bool Float(size_t at, int width, double* out) const {
    uint64_t u;
    if (!UInt(at, width, &u)) return false;
    if (width == 4) {
      float f;
      const uint32_t u32 = static_cast<uint32_t>(u);
      std::memcpy(&f, &u32, 4);
      *out = f;
      return true;
    }
    if (width == 8) {
      std::memcpy(out, &u, 8);
      return true;
    }
    return false;
  }
  // The position `offset` bytes before `at` (FlexBuffers offsets point back).
  bool Back(size_t at, uint64_t offset, size_t* out) const {
    if (offset > at) return false;
    *out = at - offset;
    return true;
  }
  // A NUL-terminated string at `at`.
  bool CString(size_t at, std::string* out) const {
    if (at >= size_) return false;
    const void* end = std::memchr(data_ + at, 0, size_ - at);
    if (end == nullptr) return false;
    out->assign(reinterpret_cast<const char*>(data_ + at),
                static_cast<const uint8_t*>(end) - (data_ + at));
    return true;
  }

 private:
  const uint8_t* data_;
  size_t size_;
};

}  // namespace

std::string FlexMap::Parse(const uint8_t* data, size_t size) {
  ints_.clear();
  const std::string bad = "the op's custom options are not a FlexBuffers map";
  if (data == nullptr || size < 3) return bad + " (too short)";
  const Reader r(data, size);
  const int root_width = data[size - 1];
  const int root_type = data[size - 2] >> 2;
  const int map_width = 1 << (data[size - 2] & 3);
  if (root_type != kMap) return bad + " (the root is not a map)";
  if (root_width < 1 || static_cast<size_t>(root_width) > size - 2) return bad;
  const size_t root = size - 2 - root_width;
  uint64_t offset, count, keys_offset, keys_width;
  size_t values, keys;
  if (!r.UInt(root, root_width, &offset) || !r.Back(root, offset, &values) ||
      values < 3 * static_cast<size_t>(map_width) ||
      !r.UInt(values - map_width, map_width, &count) ||
      !r.UInt(values - 2 * map_width, map_width, &keys_width) ||
      !r.UInt(values - 3 * map_width, map_width, &keys_offset) ||
      !r.Back(values - 3 * map_width, keys_offset, &keys)) {
    return bad + " (an offset points outside it)";
  }
  if (count > 1024 || !r.Has(values, count * map_width + count) ||
      !r.Has(keys, count * keys_width)) {
    return bad + " (its size does not fit the buffer)";
  }
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t key_offset;
    size_t key_at;
    std::string key;
    const size_t key_slot = keys + i * keys_width;
    if (!r.UInt(key_slot, static_cast<int>(keys_width), &key_offset) ||
        !r.Back(key_slot, key_offset, &key_at) || !r.CString(key_at, &key)) {
      return bad + " (a key is not a string inside it)";
    }
    const uint8_t packed = data[values + count * map_width + i];
    const int type = packed >> 2, width = 1 << (packed & 3);
    const size_t slot = values + i * map_width;
    size_t at = slot;
    int value_width = map_width;
    if (type == kIndirectInt || type == kIndirectUInt ||
        type == kIndirectFloat) {
      uint64_t indirect;
      if (!r.UInt(slot, map_width, &indirect) || !r.Back(slot, indirect, &at)) {
        return bad + " (a value points outside it)";
      }
      value_width = width;
    }
    int64_t v = 0;
    bool number = true;
    if (type == kInt || type == kIndirectInt) {
      number = r.Int(at, value_width, &v);
    } else if (type == kUInt || type == kIndirectUInt || type == kBool) {
      uint64_t u;
      number = r.UInt(at, value_width, &u) && u <= INT64_MAX;
      v = static_cast<int64_t>(u);
    } else if (type == kFloat || type == kIndirectFloat) {
      double d;
      number = r.Float(at, value_width, &d) && std::isfinite(d) &&
               d == std::floor(d) && std::fabs(d) < 9e15;
      v = static_cast<int64_t>(d);
    } else {
      number = false;
    }
    if (number) ints_.emplace_back(key, v);
  }
  return "";
}

bool FlexMap::Get(const char* key, int64_t* value) const {
  for (const auto& entry : ints_) {
    if (entry.first == key) {
      *value = entry.second;
      return true;
    }
  }
  return false;
}

}  // namespace lite
}  // namespace tapehook
