// FreeList: the free DRAM slots of a BlockPool or extents of a DiskTier, a thread-safe stack
// of indices: the last one given back is the next one taken.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace tpusync {

class FreeList {
 public:
  // Replaces the content; `free.back()` is taken first.
  void Assign(std::vector<uint32_t> free) {
    std::lock_guard lock(mu_);
    free_ = std::move(free);
  }
  std::optional<uint32_t> Take() {
    std::lock_guard lock(mu_);
    if (free_.empty()) return std::nullopt;
    uint32_t i = free_.back();
    free_.pop_back();
    return i;
  }
  void Give(uint32_t i) {
    std::lock_guard lock(mu_);
    free_.push_back(i);
  }
  uint32_t size() const {
    std::lock_guard lock(mu_);
    return static_cast<uint32_t>(free_.size());
  }

 private:
  mutable std::mutex mu_;
  std::vector<uint32_t> free_;  // guarded by mu_
};

}  // namespace tpusync
