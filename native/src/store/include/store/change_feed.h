// ChangeFeed: the keys whose tier changed, in order, for whoever announces what the store
// holds (the engines' KV events to llm-d). The store records a key whenever a block enters
// or leaves DRAM, the disk or (this host's view of) the shared tier; a reader long-polls for
// the keys recorded since its cursor and asks the store where they are now.
//
// A bounded ring: recording never waits for readers. A reader that fell more than `capacity`
// changes behind, or holds a cursor of another feed (the sidecar restarted), is told the
// changes were lost and should reread everything it announced.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "tpusync/block_key.h"
#include "tpusync/types.h"

namespace tpusync {

class ChangeFeed {
 public:
  explicit ChangeFeed(size_t capacity = size_t{1} << 16);
  ChangeFeed(const ChangeFeed&) = delete;
  ChangeFeed& operator=(const ChangeFeed&) = delete;

  void Record(const BlockKey& key);
  // The changes after `since`, up to `max_keys`; waits up to `wait` for the first one. A cursor
  // of another epoch (a first read passes {}) reads as lost, with `next` at the newest change.
  ChangeBatch Since(ChangeCursor since, std::chrono::milliseconds wait, size_t max_keys);
  uint64_t epoch() const { return epoch_; }

 private:
  const uint64_t epoch_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<BlockKey> ring_;  // guarded by mu_: change n at ring_[n % size]
  uint64_t head_ = 0;           // guarded by mu_: changes recorded so far
  uint32_t waiters_ = 0;        // guarded by mu_
};

}  // namespace tpusync
