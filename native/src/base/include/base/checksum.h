// Block checksums: XXH3-64 (tens of GB/s, so verifying every block costs little).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tpusync {

uint64_t Checksum(const void* data, size_t len);

// The checksum of an on-disk header over every field before its last one, `header_sum`.
template <typename Header>
uint64_t HeaderSum(const Header& h) {
  return Checksum(&h, offsetof(Header, header_sum));
}

// The same digest computed over consecutive pieces (e.g. each chunk as it leaves or
// arrives on a socket, while it is still in cache).
class StreamingChecksum {
 public:
  StreamingChecksum();
  ~StreamingChecksum();
  StreamingChecksum(const StreamingChecksum&) = delete;
  StreamingChecksum& operator=(const StreamingChecksum&) = delete;
  void Update(const void* data, size_t len);
  uint64_t Digest() const;

 private:
  void* state_;  // XXH3_state_t, 64-byte aligned
};

}  // namespace tpusync
