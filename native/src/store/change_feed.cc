#include "store/change_feed.h"

#include <algorithm>
#include <random>

namespace tpusync {
namespace {

uint64_t NewEpoch() {
  std::random_device rd;
  uint64_t e = 0;
  while (e == 0) e = (uint64_t{rd()} << 32) ^ rd();
  return e;
}

}  // namespace

ChangeFeed::ChangeFeed(size_t capacity) : epoch_(NewEpoch()), ring_(std::max<size_t>(capacity, 1)) {}

void ChangeFeed::Record(const BlockKey& key) {
  std::lock_guard lock(mu_);
  ring_[head_ % ring_.size()] = key;
  ++head_;
  if (waiters_ > 0) cv_.notify_all();
}

ChangeBatch ChangeFeed::Since(ChangeCursor since, std::chrono::milliseconds wait, size_t max_keys) {
  std::unique_lock lock(mu_);
  ChangeBatch b;
  if (since.epoch != epoch_ || since.seq > head_ || head_ - since.seq > ring_.size()) {
    b.lost = true;
    b.next = {epoch_, head_};
    return b;
  }
  if (since.seq == head_ && wait.count() > 0) {
    ++waiters_;
    cv_.wait_for(lock, wait, [&] { return head_ != since.seq; });
    --waiters_;
  }
  // Overrun while we waited: the oldest unread changes were overwritten.
  if (head_ - since.seq > ring_.size()) {
    b.lost = true;
    b.next = {epoch_, head_};
    return b;
  }
  const uint64_t end = std::min<uint64_t>(head_, since.seq + max_keys);
  b.keys.reserve(end - since.seq);
  for (uint64_t n = since.seq; n < end; ++n) b.keys.push_back(ring_[n % ring_.size()]);
  b.next = {epoch_, end};
  return b;
}

}  // namespace tpusync
