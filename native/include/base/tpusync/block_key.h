// BlockKey: the 128-bit content address of a block (a chained prefix hash).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace tpusync {

struct BlockKey {
  uint64_t hi = 0;
  uint64_t lo = 0;

  friend bool operator==(const BlockKey&, const BlockKey&) = default;
  std::string ToHex() const;  // 32 lower-case hex digits, hi first
};

struct BlockKeyHash {
  // Keys are already hashes; fold the halves so either half alone spreads well.
  size_t operator()(const BlockKey& k) const noexcept {
    return static_cast<size_t>(k.lo ^ (k.hi * 0x9E3779B97F4A7C15ULL));
  }
};

}  // namespace tpusync
