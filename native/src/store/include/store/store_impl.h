// StoreImpl: the implementation behind Store (tpusync/store.h), its lock, queues and index.
// One class over several files, by concern: store.cc (open, stats, the public facade),
// store_slots.cc (DRAM slots and disk extents), store_writeback.cc (write-behind and the
// shared tier's writes and promotions), store_io.cc (put, get), store_index.cc (lookup, pins,
// eviction), store_leases.cc (zero-copy leases).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "store/block_index.h"
#include "store/block_pool.h"
#include "store/change_feed.h"
#include "store/disk_tier.h"
#include "store/shared_tier.h"
#include "tpusync/store.h"

namespace tpusync {

// The implementation behind Store: its lock, queues and index stay out of the public header.
class StoreImpl {
 public:
  static Result<std::unique_ptr<StoreImpl>> Open(const StoreOptions& options);
  ~StoreImpl();

  Status Put(std::span<const BlockKey> keys, std::span<const ConstBuffer> buffers);
  Status Get(std::span<const BlockKey> keys, std::span<const MutableBuffer> out, std::span<uint8_t> found);
  LookupResult Lookup(std::span<const BlockKey> keys, bool pin_prefix);
  std::vector<Tier> Where(std::span<const BlockKey> keys);
  Status Pin(std::span<const BlockKey> keys);
  Status Release(std::span<const BlockKey> keys);
  Status Evict(std::span<const BlockKey> keys);
  Status Flush();
  StoreStats Stats() const;

  Result<WriteLease> Reserve(const BlockKey& key, bool wait);
  Result<ReadLease> Acquire(const BlockKey& key);
  ChangeFeed& feed() { return feed_; }
  SharedTier* shared() { return shared_.get(); }

  const BlockPool& pool() const { return *pool_; }

 private:
  friend class Store;
  friend class WriteLease;
  friend class ReadLease;
  struct Counters;
  StoreImpl() = default;

  using TimePoint = std::chrono::steady_clock::time_point;
  // All *Locked helpers run with mu_ held; the ones taking the lock may drop it while waiting.
  // Without a deadline they never wait. A writer also waits for leases to be given back; a
  // promotion does not (it reads through a staging buffer instead).
  Result<uint32_t> AcquireSlotLocked(std::unique_lock<std::mutex>& lock, std::optional<TimePoint> deadline,
                                     bool wait_for_leases);
  Result<IndexEntry*> ClaimLocked(std::unique_lock<std::mutex>& lock, const BlockKey& key,
                                  std::optional<TimePoint> deadline, bool wait_for_others);
  std::optional<TimePoint> WriteDeadline() const { return std::chrono::steady_clock::now() + write_wait_; }
  std::optional<uint32_t> AcquireExtentLocked();
  void DropDramLocked(IndexEntry& e);
  void MaybeStartWritebackLocked();
  // Whether a block leaving DRAM is written somewhere first, and whether it has been.
  bool writes_behind() const { return disk_ != nullptr || shared_demote_; }
  bool HasLowerCopy(const IndexEntry& e) const {
    return (!disk_ || e.on_disk()) && (!shared_demote_ || e.on_shared);
  }
  void QueueSharedLocked(IndexEntry& e);
  Status WriteSharedLocked(std::unique_lock<std::mutex>& lock, const BlockKey& key);
  Status PromoteSharedLocked(std::unique_lock<std::mutex>& lock, const BlockKey& key);
  Status ReadSharedStaged(const BlockKey& key, const MutableBuffer& out);
  void ReleaseSharedPinsLocked(IndexEntry& e);
  void StartDemotionLocked(IndexEntry& e);
  Status DemoteLocked(std::unique_lock<std::mutex>& lock, const BlockKey& key);
  Status CopyOutLocked(std::unique_lock<std::mutex>& lock, IndexEntry& e, const MutableBuffer& out);
  Status PromoteLocked(std::unique_lock<std::mutex>& lock, IndexEntry& e, const MutableBuffer* out,
                       std::optional<TimePoint> deadline);
  void RecordErrorLocked(const Status& st);
  void IoLoop(const std::stop_token& stop);
  void CommitLease(WriteLease& lease, uint64_t length, Status* result);
  void AbortLease(WriteLease& lease);
  void ReleaseRead(const BlockKey& key);

  ChangeFeed feed_;  // first: the shared tier's evictor records into it until it stops
  std::unique_ptr<BlockPool> pool_;
  std::unique_ptr<DiskTier> disk_;  // null without a disk tier
  std::unique_ptr<SharedTier> shared_;  // null without a shared tier
  bool shared_demote_ = false;      // the shared tier takes blocks leaving DRAM, not every put
  uint32_t writeback_low_ = 0;      // free-slot count that starts write-behind
  uint32_t max_pending_ = 0;        // demotions in flight at most
  std::chrono::milliseconds write_wait_{0};

  mutable std::mutex mu_;
  std::condition_variable_any cv_;     // slot freed, demotion or promotion done, work queued
  BlockIndex index_;                   // guarded by mu_
  std::deque<BlockKey> demote_queue_;  // guarded by mu_
  std::deque<BlockKey> promote_queue_;  // guarded by mu_: read-ahead of batched gets
  std::deque<BlockKey> shared_queue_;   // guarded by mu_: write-through to the shared tier
  size_t read_ahead_ = 0;               // disk blocks a get asks the io threads to read ahead
  uint32_t pending_demotions_ = 0;     // guarded by mu_: queued + running
  uint32_t busy_ = 0;                  // guarded by mu_: copies in flight that will free or commit a slot
  uint32_t leases_ = 0;                // guarded by mu_: write and read leases outstanding
  uint32_t shared_writes_ = 0;         // guarded by mu_: shared-tier writes in flight
  uint32_t waiting_writers_ = 0;       // guarded by mu_: in ClaimLocked's and AcquireSlotLocked's waits
  uint64_t tick_ = 0;                  // guarded by mu_
  uint64_t seq_ = 0;                   // guarded by mu_
  Status flush_error_;                 // guarded by mu_
  std::unique_ptr<Counters> c_;        // guarded by mu_
  std::vector<std::jthread> io_threads_;
};

struct StoreImpl::Counters {
  uint64_t puts = 0, put_dedup = 0, bytes_put = 0;
  uint64_t hits_dram = 0, hits_disk = 0, misses = 0, bytes_got = 0;
  uint64_t evictions = 0, demotions = 0, promotions = 0, disk_evictions = 0;
  uint64_t corruptions = 0, disk_write_errors = 0, disk_read_errors = 0, dropped = 0;
  uint64_t recovered_dram = 0, recovered_disk = 0;
  uint64_t hits_shared = 0;
  std::string last_error;
};

}  // namespace tpusync
