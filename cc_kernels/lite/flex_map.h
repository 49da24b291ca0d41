// Reads the integer entries of a FlexBuffers map: the custom options LCE's
// converter writes for its ops (flatbuffers/flexbuffers.h's format: the
// root's type and width in the last two bytes, a map as a keys vector and a
// values vector with a type byte per value). Every offset is checked against
// the buffer, so a corrupt file gives an error, never a read outside it.
#ifndef TAPEHOOK_LITE_FLEX_MAP_H_
#define TAPEHOOK_LITE_FLEX_MAP_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tapehook {
namespace lite {

class FlexMap {
 public:
  // "" or what is wrong with the buffer.
  std::string Parse(const uint8_t* data, size_t size);

  // The entry's value as an integer (ints, uints, bools, floats with an
  // integral value); false when the key is absent or not a number.
  bool Get(const char* key, int64_t* value) const;

 private:
  std::vector<std::pair<std::string, int64_t>> ints_;
};

}  // namespace lite
}  // namespace tapehook

#endif  // TAPEHOOK_LITE_FLEX_MAP_H_
