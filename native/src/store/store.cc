#include "tpusync/store.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <cstring>
#include <optional>
#include <unordered_map>

#include "base/copy.h"
#include "store/block_pool.h"
#include "store/disk_tier.h"
#include "base/log.h"
#include "base/posix_io.h"

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
  uint32_t shared_writes_ = 0;
  uint32_t waiting_writers_ = 0;       // guarded by mu_: in ClaimLocked's and AcquireSlotLocked's waits         // guarded by mu_: shared-tier writes in flight
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

Result<std::unique_ptr<StoreImpl>> StoreImpl::Open(const StoreOptions& o) {
  std::unique_ptr<StoreImpl> s(new StoreImpl());
  s->c_ = std::make_unique<Counters>();
  TPUSYNC_ASSIGN_OR_RETURN(s->pool_, BlockPool::Create(o.pool));
  if (o.disk_enabled) {
    DiskTierOptions d = o.disk;
    d.block_bytes = s->pool_->block_bytes();
    TPUSYNC_ASSIGN_OR_RETURN(s->disk_, DiskTier::Open(d));
  }
  if (o.shared_enabled) {
    SharedTierOptions sh = o.shared;
    sh.block_bytes = s->pool_->block_bytes();
    sh.on_changed = [feed = &s->feed_](const BlockKey& key) { feed->Record(key); };
    TPUSYNC_ASSIGN_OR_RETURN(s->shared_, SharedTier::Open(sh));
    s->shared_demote_ = o.shared_policy == SharedPolicy::kDemote;
  }
  const uint32_t slots = s->pool_->num_slots();
  s->max_pending_ = std::max<uint32_t>(2, 2 * o.io_threads);
  // At least max_pending_ slots free or on their way out, so every I/O thread always has a
  // block: one checksums its next while another's write is in flight and the disk never
  // waits. A small pool's 5% is one slot, which left one demotion at a time and the disk
  // idle during each checksum (disk put at 0.67 of O_DIRECT in 2 MiB blocks).
  s->writeback_low_ = std::max({uint32_t{1}, static_cast<uint32_t>(slots * o.writeback_watermark),
                                std::min(s->max_pending_, slots / 2)});
  s->write_wait_ = o.write_wait;
  s->read_ahead_ = s->disk_ || s->shared_ ? std::min<size_t>(o.io_threads, slots / 8) : 0;

  // Rebuild the index, oldest first so the newest ends up most recent.
  for (const RecoveredSlot& r : s->pool_->recovered()) {
    IndexEntry& e = s->index_.Insert(r.key);
    e.length = r.length;
    s->index_.SetDram(e, r.slot);
    s->tick_ = std::max(s->tick_, r.tick);
    ++s->c_->recovered_dram;
  }
  if (s->disk_) {
    if (s->disk_->damaged_at_open() > 0) {
      Log(LogLevel::kWarning, "disk",
          std::to_string(s->disk_->damaged_at_open()) + " damaged extent headers in " + s->disk_->path() + " ignored");
      s->c_->corruptions += s->disk_->damaged_at_open();
    }
    for (const RecoveredExtent& r : s->disk_->recovered()) {
      IndexEntry& e = s->index_.Insert(r.key);
      if (e.length != 0 && e.length != r.length) {
        s->disk_->Free(r.extent);  // disagrees with the DRAM copy: the DRAM copy wins
        continue;
      }
      e.length = r.length;
      s->index_.SetDisk(e, r.extent);
      s->seq_ = std::max(s->seq_, r.seq);
      ++s->c_->recovered_disk;
    }
  }
  s->index_.set_feed(&s->feed_);  // after the rebuild: a reader's first batch reads as lost anyway
  if (s->disk_ || s->shared_) {
    for (uint32_t i = 0; i < o.io_threads; ++i) {
      s->io_threads_.emplace_back([p = s.get()](const std::stop_token& st) { p->IoLoop(st); });
    }
  }
  return s;
}

StoreImpl::~StoreImpl() {
  for (auto& t : io_threads_) t.request_stop();
  cv_.notify_all();
  io_threads_.clear();  // joins
}

// ---- slots and extents ----------------------------------------------------------------

void StoreImpl::DropDramLocked(IndexEntry& e) {
  pool_->Free(e.slot);
  index_.ClearDram(e);
  ++c_->evictions;
  if (!e.on_disk() && e.pins == 0) index_.Erase(e.key);
  cv_.notify_all();
}

void StoreImpl::ReleaseSharedPinsLocked(IndexEntry& e) {
  for (; e.shared_pins > 0; --e.shared_pins) shared_->Release(e.key);
}

Result<uint32_t> StoreImpl::AcquireSlotLocked(std::unique_lock<std::mutex>& lock, std::optional<TimePoint> deadline,
                                         bool wait_for_leases) {
  for (;;) {
    if (auto slot = pool_->Allocate()) return *slot;
    IndexEntry* victim = index_.DramVictim();
    // Without a write-behind to wait for, a clean copy below, or no lower tier: drop it now.
    if (victim != nullptr && (!writes_behind() || HasLowerCopy(*victim))) {
      DropDramLocked(*victim);
      continue;
    }
    if (!deadline) return ResourceExhausted("no DRAM slot free without waiting");
    if (victim != nullptr && pending_demotions_ < max_pending_) {
      StartDemotionLocked(*victim);
      continue;
    }
    // Nothing that will free a slot by itself: only pins (and leases, for a promotion).
    if (victim == nullptr && pending_demotions_ == 0 && busy_ == 0 && shared_queue_.empty() && shared_writes_ == 0 &&
        (leases_ == 0 || !wait_for_leases)) {
      return ResourceExhausted("all " + std::to_string(pool_->num_slots()) + " DRAM slots hold pinned or leased blocks");
    }
    if (std::chrono::steady_clock::now() >= *deadline) {
      return ResourceExhausted("no DRAM slot freed within " + std::to_string(write_wait_.count()) + " ms: " +
                               std::to_string(leases_) + " leases and " + std::to_string(pending_demotions_) +
                               " write-behinds hold the " + std::to_string(pool_->num_slots()) + " slots");
    }
    ++waiting_writers_;
    cv_.wait_until(lock, *deadline);
    --waiting_writers_;
  }
}

// Makes `key` the caller's to write: an entry marked writing with a DRAM slot, or nullptr
// if the key is stored already. Another writer of the key (and a slot held by another
// lease) is waited for until `deadline` when `wait_for_others`: if it gives up, the key is
// written here, so a write is never acknowledged on the strength
// of a write that did not happen.
Result<IndexEntry*> StoreImpl::ClaimLocked(std::unique_lock<std::mutex>& lock, const BlockKey& key,
                                       std::optional<TimePoint> deadline, bool wait_for_others) {
  for (;;) {
    IndexEntry* e = index_.Find(key);
    if (e != nullptr && e->writing) {
      if (!wait_for_others || !deadline || std::chrono::steady_clock::now() >= *deadline) {
        return Status(StatusCode::kUnavailable, "block " + key.ToHex() + " is being written by another writer");
      }
      ++waiting_writers_;
      cv_.wait_until(lock, *deadline);
      --waiting_writers_;
      continue;
    }
    if (e != nullptr && e->tier() != Tier::kNone) return nullptr;
    TPUSYNC_ASSIGN_OR_RETURN(uint32_t slot, AcquireSlotLocked(lock, deadline, wait_for_others));
    e = index_.Find(key);
    if (e != nullptr && (e->writing || e->tier() != Tier::kNone)) {  // changed while we waited
      pool_->Free(slot);
      continue;
    }
    // An entry without a tier (a pinned block whose disk copy failed verification) is
    // written again in place; its pins stay.
    IndexEntry& claimed = index_.Insert(key);
    claimed.writing = true;
    claimed.slot = slot;
    return &claimed;
  }
}

std::optional<uint32_t> StoreImpl::AcquireExtentLocked() {
  for (;;) {
    if (auto e = disk_->Allocate()) return e;
    IndexEntry* victim = index_.DiskVictim();
    if (victim == nullptr) return std::nullopt;
    disk_->Free(victim->extent);
    index_.ClearDisk(*victim);
    ++c_->disk_evictions;
    if (!victim->in_dram() && !victim->writing && victim->pins == 0) index_.Erase(victim->key);
  }
}

// ---- write-behind ---------------------------------------------------------------------

void StoreImpl::StartDemotionLocked(IndexEntry& e) {
  e.demoting = true;
  e.drop_slot_after_demote = true;
  demote_queue_.push_back(e.key);
  ++pending_demotions_;
  cv_.notify_all();
}

void StoreImpl::MaybeStartWritebackLocked() {
  if (!writes_behind()) return;
  uint32_t free = pool_->free_slots();
  while (free + pending_demotions_ < writeback_low_ && pending_demotions_ < max_pending_) {
    IndexEntry* victim = index_.DramVictim();
    if (victim == nullptr) return;
    if (HasLowerCopy(*victim)) {
      DropDramLocked(*victim);
      ++free;
    } else {
      StartDemotionLocked(*victim);
    }
  }
}

// Writes one DRAM block to disk with the lock dropped; the caller set e.demoting.
Status StoreImpl::DemoteLocked(std::unique_lock<std::mutex>& lock, const BlockKey& key) {
  IndexEntry* e = index_.Find(key);
  if (e == nullptr) return Status::Ok();
  Status st = Status::Ok();
  if (disk_ && e->in_dram() && !e->on_disk()) {
    std::optional<uint32_t> extent = AcquireExtentLocked();
    if (!extent) {
      st = ResourceExhausted("disk tier full: every extent holds a pinned or in-use block");
      RecordErrorLocked(st);
    } else {
      const std::byte* src = pool_->data(e->slot);
      uint64_t length = e->length, seq = ++seq_;
      lock.unlock();
      st = disk_->Write(*extent, key, src, length, seq);
      lock.lock();
      e = index_.Find(key);  // still present: a demoting block is never evicted
      if (st.ok()) {
        index_.SetDisk(*e, *extent);
        ++c_->demotions;
      } else {
        disk_->Free(*extent);
        ++c_->disk_write_errors;
        RecordErrorLocked(st);
      }
    }
  }
  if (shared_demote_ && e->in_dram() && !e->on_shared) {
    (void)WriteSharedLocked(lock, key);  // counted by the tier; a demoting block stays put meanwhile
    e = index_.Find(key);
  }
  e->demoting = false;
  // A failed demotion still frees the slot: DRAM is a cache and must not stall.
  if (std::exchange(e->drop_slot_after_demote, false) && e->pins == 0 && e->dram_readers == 0) {
    const uint64_t dropped = e->on_disk() || e->on_shared ? 0 : ++c_->dropped;
    if (dropped != 0 && (dropped & (dropped - 1)) == 0) {  // logged at the 1st, 2nd, 4th, ... drop
      Log(LogLevel::kWarning, "disk",
          std::to_string(dropped) + " blocks dropped from DRAM without a disk copy so far; latest: " + st.ToString());
    }
    DropDramLocked(*e);
  }
  cv_.notify_all();
  return st;
}

void StoreImpl::IoLoop(const std::stop_token& stop) {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, stop, [&] { return !demote_queue_.empty() || !promote_queue_.empty() || !shared_queue_.empty(); });
    if (stop.stop_requested()) return;
    if (demote_queue_.empty() && !shared_queue_.empty()) {
      BlockKey key = shared_queue_.front();
      shared_queue_.pop_front();
      (void)WriteSharedLocked(lock, key);  // counted and logged by the tier; the block stays in DRAM
      if (IndexEntry* e = index_.Find(key)) e->shared_queued = false;
      cv_.notify_all();
      continue;
    }
    if (demote_queue_.empty()) {  // read-ahead for a batched get, only into slots free right now
      BlockKey key = promote_queue_.front();
      promote_queue_.pop_front();
      IndexEntry* e = index_.Find(key);
      Tier from = Tier::kNone;
      if (e != nullptr && !e->in_dram() && e->on_disk() && !e->promoting) {
        if (PromoteLocked(lock, *e, nullptr, std::nullopt).ok()) from = Tier::kDisk;
      } else if (shared_ && (e == nullptr || (e->tier() == Tier::kNone && !e->writing))) {
        if (PromoteSharedLocked(lock, key).ok()) from = Tier::kShared;
      }
      if (IndexEntry* p = index_.Find(key); p != nullptr && from != Tier::kNone) p->read_ahead_from = from;
      continue;
    }
    BlockKey key = demote_queue_.front();
    demote_queue_.pop_front();
    Status st = DemoteLocked(lock, key);
    if (!st.ok() && flush_error_.ok()) flush_error_ = st;  // surfaces through Flush
    --pending_demotions_;
    cv_.notify_all();
  }
}

Status StoreImpl::Flush() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return pending_demotions_ == 0 && shared_queue_.empty() && shared_writes_ == 0; });
  return std::exchange(flush_error_, Status::Ok());
}

// ---- the shared tier ----------------------------------------------------------------------

void StoreImpl::QueueSharedLocked(IndexEntry& e) {
  if (!shared_ || shared_demote_ || e.on_shared) return;
  e.shared_queued = true;  // kept in DRAM until written: write-through means every block
  shared_queue_.push_back(e.key);
  cv_.notify_all();
}

// Writes a DRAM block to the shared tier with the lock dropped; the slot is held meanwhile.
Status StoreImpl::WriteSharedLocked(std::unique_lock<std::mutex>& lock, const BlockKey& key) {
  IndexEntry* e = index_.Find(key);
  if (e == nullptr || !e->in_dram() || e->on_shared) return Status::Ok();
  ++e->dram_readers;
  ++shared_writes_;
  const std::byte* src = pool_->data(e->slot);
  const uint64_t length = e->length;
  lock.unlock();
  Status st = shared_->Write(key, src, length);
  lock.lock();
  --shared_writes_;
  e = index_.Find(key);  // still present: a block being read is never evicted
  --e->dram_readers;
  if (st.ok()) {
    e->on_shared = true;
  } else {
    RecordErrorLocked(st);
  }
  cv_.notify_all();
  return st;
}

// Brings a block that only the shared tier holds into a DRAM slot, claimed as a writer claims
// one (so a put of the same key meanwhile waits, and the slot is never half-written to a
// reader). OK: the key is in DRAM now (promoted here, or stored meanwhile by another caller);
// kNotFound: absent; kResourceExhausted: no slot free; kDataLoss: the file was damaged.
Status StoreImpl::PromoteSharedLocked(std::unique_lock<std::mutex>& lock, const BlockKey& key) {
  TPUSYNC_ASSIGN_OR_RETURN(IndexEntry * e, ClaimLocked(lock, key, std::nullopt, false));
  if (e == nullptr) return Status::Ok();
  const uint32_t slot = e->slot;
  e->promoting = true;  // a get of the key meanwhile waits for this read instead of repeating it
  ++busy_;
  lock.unlock();
  Result<uint64_t> n = shared_->Read(key, pool_->data(slot), pool_->block_bytes());
  lock.lock();
  --busy_;
  e = index_.Find(key);  // a claimed key stays
  e->writing = false;
  e->promoting = false;
  cv_.notify_all();
  if (!n.ok()) {
    pool_->Free(slot);
    e->slot = IndexEntry::kNoLocation;
    if (e->pins == 0) index_.Erase(key);
    if (n.status().code() != StatusCode::kNotFound) RecordErrorLocked(n.status());
    return n.status();
  }
  e->length = *n;
  e->on_shared = true;
  pool_->Commit(slot, key, e->length, ++tick_);
  index_.SetDram(*e, slot);
  ++c_->promotions;
  MaybeStartWritebackLocked();
  return Status::Ok();
}

// A shared-tier read through a staging buffer, for when no DRAM slot is free.
Status StoreImpl::ReadSharedStaged(const BlockKey& key, const MutableBuffer& out) {
  AlignedBuffer staging(pool_->block_bytes());
  TPUSYNC_ASSIGN_OR_RETURN(uint64_t n, shared_->Read(key, staging.data(), staging.size()));
  if (n != out.size) return NotFound("shared tier: block " + key.ToHex() + " does not fill the buffer");
  CopyBytes(out.data, staging.data(), n);
  return Status::Ok();
}

// ---- put / get ------------------------------------------------------------------------

Status StoreImpl::Put(std::span<const BlockKey> keys, std::span<const ConstBuffer> buffers) {
  if (keys.size() != buffers.size()) {
    return InvalidArgument("put: " + std::to_string(keys.size()) + " keys but " + std::to_string(buffers.size()) +
                           " buffers");
  }
  const uint64_t bb = pool_->block_bytes();
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (buffers[i].size == 0 || buffers[i].size > bb) {
      return InvalidArgument("put: buffer " + std::to_string(i) + " holds " + std::to_string(buffers[i].size) +
                             " bytes; blocks hold 1.." + std::to_string(bb));
    }
  }
  std::unique_lock lock(mu_);
  for (size_t i = 0; i < keys.size(); ++i) {
    TPUSYNC_ASSIGN_OR_RETURN(IndexEntry * e, ClaimLocked(lock, keys[i], WriteDeadline(), true));
    if (e == nullptr) {
      ++c_->put_dedup;
      continue;
    }
    const uint32_t slot = e->slot;
    ++busy_;
    lock.unlock();
    CopyBytes(pool_->data(slot), buffers[i].data, buffers[i].size);
    lock.lock();
    --busy_;
    IndexEntry* w = index_.Find(keys[i]);
    w->writing = false;
    w->length = buffers[i].size;
    pool_->Commit(slot, keys[i], w->length, ++tick_);
    index_.SetDram(*w, slot);
    ++c_->puts;
    c_->bytes_put += w->length;
    QueueSharedLocked(*w);
    MaybeStartWritebackLocked();
    cv_.notify_all();
  }
  return Status::Ok();
}

Status StoreImpl::CopyOutLocked(std::unique_lock<std::mutex>& lock, IndexEntry& e, const MutableBuffer& out) {
  ++e.dram_readers;
  index_.TouchDram(e);
  pool_->Touch(e.slot, ++tick_);
  const std::byte* src = pool_->data(e.slot);
  const BlockKey key = e.key;
  const uint64_t length = e.length;
  ++busy_;
  lock.unlock();
  CopyBytes(out.data, src, length);
  lock.lock();
  --busy_;
  IndexEntry* r = index_.Find(key);  // still present: a block being read is never evicted
  if (--r->dram_readers == 0) cv_.notify_all();
  c_->bytes_got += length;
  return Status::Ok();
}

// Reads a disk block into a fresh DRAM slot, then copies it to `out` if given. When DRAM is
// full of pinned blocks the read goes through a staging buffer instead, without promotion.
// On a failed verification the disk copy is dropped and the error returned (a miss).
Status StoreImpl::PromoteLocked(std::unique_lock<std::mutex>& lock, IndexEntry& entry, const MutableBuffer* out,
                            std::optional<TimePoint> deadline) {
  const BlockKey key = entry.key;
  entry.promoting = true;
  ++entry.disk_readers;
  Result<uint32_t> slot = AcquireSlotLocked(lock, deadline, false);
  IndexEntry* e = index_.Find(key);  // promoting blocks are not evicted
  const uint32_t extent = e->extent;
  const uint64_t length = e->length;
  Status st = slot.status();
  std::optional<AlignedBuffer> staging;
  if (slot.ok() || out != nullptr) {
    if (!slot.ok()) staging.emplace(pool_->block_bytes());
    std::byte* dst = slot.ok() ? pool_->data(*slot) : staging->data();
    ++busy_;
    lock.unlock();
    st = disk_->Read(extent, key, length, dst);
    if (st.ok() && staging) CopyBytes(out->data, dst, length);
    lock.lock();
    --busy_;
    e = index_.Find(key);
  }
  --e->disk_readers;
  e->promoting = false;
  cv_.notify_all();
  if (!st.ok()) {
    if (slot.ok()) pool_->Free(*slot);
    if (st.code() == StatusCode::kResourceExhausted && !slot.ok()) return st;  // no slot; the disk copy is fine
    (st.code() == StatusCode::kDataLoss ? c_->corruptions : c_->disk_read_errors)++;
    RecordErrorLocked(st);
    Log(LogLevel::kWarning, "disk", "block treated as a miss: " + st.message());
    disk_->Free(extent);
    index_.ClearDisk(*e);
    if (!e->in_dram() && e->pins == 0) index_.Erase(key);
    return st;
  }
  if (staging) {
    c_->bytes_got += length;
    return Status::Ok();
  }
  pool_->Commit(*slot, key, length, ++tick_);
  index_.SetDram(*e, *slot);
  ++c_->promotions;
  return out != nullptr ? CopyOutLocked(lock, *e, *out) : Status::Ok();
}

Status StoreImpl::Get(std::span<const BlockKey> keys, std::span<const MutableBuffer> out, std::span<uint8_t> found) {
  if (keys.size() != out.size() || keys.size() != found.size()) {
    return InvalidArgument("get: " + std::to_string(keys.size()) + " keys but " + std::to_string(out.size()) +
                           " output buffers");
  }
  Status result = Status::Ok();
  std::unique_lock lock(mu_);
  size_t prefetched = 0;  // keys before this one have been offered to the read-ahead
  for (size_t i = 0; i < keys.size(); ++i) {
    found[i] = 0;
    // Disk blocks a little ahead of this one are read by the io threads meanwhile.
    for (; prefetched < std::min(keys.size(), i + 1 + read_ahead_); ++prefetched) {
      IndexEntry* p = index_.Find(keys[prefetched]);
      const bool from_disk = p != nullptr && !p->in_dram() && p->on_disk() && !p->promoting;
      const bool from_shared = shared_ && (p == nullptr || (p->tier() == Tier::kNone && !p->writing));
      if (prefetched > i && (from_disk || from_shared)) {
        promote_queue_.push_back(keys[prefetched]);
        cv_.notify_all();
      }
    }
    IndexEntry* e = index_.Find(keys[i]);
    while (e != nullptr && e->promoting) {  // another reader is bringing it up: share its work
      cv_.wait(lock);
      e = index_.Find(keys[i]);
    }
    bool from_shared = false;
    if ((e == nullptr || e->tier() == Tier::kNone) && shared_ && (e == nullptr || !e->writing)) {
      Status st = PromoteSharedLocked(lock, keys[i]);
      if (st.code() == StatusCode::kResourceExhausted || st.code() == StatusCode::kUnavailable) {
        lock.unlock();
        st = ReadSharedStaged(keys[i], out[i]);
        lock.lock();
        if (st.ok()) {
          ++c_->hits_shared;
          c_->bytes_got += out[i].size;
          found[i] = 1;
        } else {
          ++c_->misses;
        }
        continue;
      }
      e = index_.Find(keys[i]);
      from_shared = st.ok();
    }
    if (e == nullptr || e->tier() == Tier::kNone) {
      ++c_->misses;
      continue;
    }
    if (out[i].size < e->length) {
      if (result.ok()) {
        result = InvalidArgument("get: output buffer " + std::to_string(i) + " holds " + std::to_string(out[i].size) +
                                 " bytes, block " + keys[i].ToHex() + " holds " + std::to_string(e->length));
      }
      continue;
    }
    if (out[i].size != e->length) {  // a shorter block would leave the rest of the buffer stale
      ++c_->misses;
      continue;
    }
    if (e->in_dram()) {
      // Counted where the block came from: this get, or its read-ahead.
      const Tier from = from_shared ? Tier::kShared : std::exchange(e->read_ahead_from, Tier::kNone);
      ++(from == Tier::kShared ? c_->hits_shared : from == Tier::kDisk ? c_->hits_disk : c_->hits_dram);
      (void)CopyOutLocked(lock, *e, out[i]);
      found[i] = 1;
    } else if (PromoteLocked(lock, *e, &out[i], WriteDeadline()).ok()) {
      ++c_->hits_disk;
      found[i] = 1;
    } else {
      ++c_->misses;
    }
  }
  return result;
}

// ---- lookup, pins, eviction -------------------------------------------------------------

LookupResult StoreImpl::Lookup(std::span<const BlockKey> keys, bool pin_prefix) {
  LookupResult r;
  r.tiers.resize(keys.size(), Tier::kNone);
  std::unique_lock lock(mu_);
  for (size_t i = 0; i < keys.size(); ++i) {
    IndexEntry* e = index_.Find(keys[i]);
    r.tiers[i] = e == nullptr ? Tier::kNone : e->tier();
  }
  // The shared tier, asked without the lock (its answers are file system round trips), about
  // the prefix's keys held neither in DRAM nor on disk; a pinned key is pinned there too.
  std::vector<bool> shared(keys.size(), false);
  if (shared_) {
    lock.unlock();
    for (size_t i = 0; i < keys.size(); ++i) {
      if (r.tiers[i] != Tier::kNone) continue;
      if (pin_prefix ? !shared_->Pin(keys[i]).ok() : !shared_->Exists(keys[i])) break;
      shared[i] = true;
    }
    lock.lock();
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    IndexEntry* e = index_.Find(keys[i]);
    const Tier local = e == nullptr ? Tier::kNone : e->tier();
    const bool present = local != Tier::kNone || shared[i];
    if (r.prefix_len == i && present) {
      ++r.prefix_len;
      if (pin_prefix) {
        IndexEntry& p = e != nullptr ? *e : index_.Insert(keys[i]);
        if (p.pins++ == 0) index_.AdjustPinned(1);
        if (shared[i]) ++p.shared_pins;
      }
    } else if (shared[i] && pin_prefix) {
      shared_->Release(keys[i]);  // past a block evicted meanwhile: not in the prefix
    }
    r.tiers[i] = local != Tier::kNone ? local : shared[i] ? Tier::kShared : Tier::kNone;
  }
  return r;
}

std::vector<Tier> StoreImpl::Where(std::span<const BlockKey> keys) {
  std::vector<Tier> tiers(keys.size(), Tier::kNone);
  {
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < keys.size(); ++i) {
      const IndexEntry* e = index_.Find(keys[i]);
      tiers[i] = e == nullptr ? Tier::kNone : e->tier();
    }
  }
  for (size_t i = 0; shared_ && i < keys.size(); ++i) {  // file system round trips: without the lock
    if (tiers[i] == Tier::kNone && shared_->Exists(keys[i])) tiers[i] = Tier::kShared;
  }
  return tiers;
}

Status StoreImpl::Pin(std::span<const BlockKey> keys) {
  std::unique_lock lock(mu_);
  auto local = [&](const BlockKey& k) {
    IndexEntry* e = index_.Find(k);
    return e != nullptr && e->tier() != Tier::kNone;
  };
  // Keys held only on the shared tier are pinned there first, without the lock; a local key
  // that left meanwhile (to nowhere) fails the whole pin, as an absent key does.
  std::vector<size_t> on_shared;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!local(keys[i])) on_shared.push_back(i);
  }
  auto not_stored = [&](size_t i) {
    return NotFound("pin: block " + keys[i].ToHex() + " (key " + std::to_string(i) + ") is not stored");
  };
  if (!on_shared.empty()) {
    if (!shared_) return not_stored(on_shared.front());
    lock.unlock();
    for (size_t j = 0; j < on_shared.size(); ++j) {
      if (!shared_->Pin(keys[on_shared[j]]).ok()) {
        for (size_t k = 0; k < j; ++k) shared_->Release(keys[on_shared[k]]);
        return not_stored(on_shared[j]);
      }
    }
    lock.lock();
  }
  std::vector<bool> pinned_on_shared(keys.size(), false);
  for (size_t i : on_shared) pinned_on_shared[i] = true;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!pinned_on_shared[i] && !local(keys[i])) {
      for (size_t j : on_shared) shared_->Release(keys[j]);
      return not_stored(i);
    }
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    IndexEntry& e = index_.Insert(keys[i]);
    if (e.pins++ == 0) index_.AdjustPinned(1);
    if (pinned_on_shared[i]) ++e.shared_pins;
  }
  return Status::Ok();
}

Status StoreImpl::Release(std::span<const BlockKey> keys) {
  std::lock_guard lock(mu_);
  std::unordered_map<BlockKey, uint32_t, BlockKeyHash> need;  // a repeated key releases once per copy
  for (size_t i = 0; i < keys.size(); ++i) {
    IndexEntry* e = index_.Find(keys[i]);
    if (e == nullptr || e->pins < ++need[keys[i]]) {
      return FailedPrecondition("release: block " + keys[i].ToHex() + " (key " + std::to_string(i) +
                                ") is not pinned");
    }
  }
  for (const BlockKey& k : keys) {
    IndexEntry* e = index_.Find(k);
    if (--e->pins > 0) continue;
    index_.AdjustPinned(-1);
    ReleaseSharedPinsLocked(*e);
    if (e->tier() == Tier::kNone && !e->writing) index_.Erase(k);  // was held only on the shared tier
  }
  cv_.notify_all();
  return Status::Ok();
}

Status StoreImpl::Evict(std::span<const BlockKey> keys) {
  std::unique_lock lock(mu_);
  Status result = Status::Ok();
  bool queued = false;
  for (const BlockKey& key : keys) {
    IndexEntry* e = index_.Find(key);
    while (e != nullptr && (e->demoting || e->promoting)) {
      cv_.wait(lock);
      e = index_.Find(key);
    }
    if (e == nullptr || e->writing) continue;
    if (e->pins > 0 || e->dram_readers > 0) {
      if (result.ok()) result = FailedPrecondition("evict: block " + key.ToHex() + " is pinned or being read");
      continue;
    }
    if (e->in_dram()) {
      if (writes_behind() && !HasLowerCopy(*e)) {
        StartDemotionLocked(*e);  // the write-behind threads write the batch, several at a time
        queued = true;
      } else {
        DropDramLocked(*e);
      }
    } else if (e->on_disk() && e->disk_readers == 0) {
      disk_->Free(e->extent);
      ++c_->disk_evictions;
      index_.Erase(key);
    }
  }
  if (queued) {
    cv_.wait(lock, [&] { return pending_demotions_ == 0; });
    Status st = std::exchange(flush_error_, Status::Ok());
    if (result.ok()) result = st;
  }
  return result;
}

void StoreImpl::RecordErrorLocked(const Status& st) { c_->last_error = st.ToString(); }

StoreStats StoreImpl::Stats() const {
  std::lock_guard lock(mu_);
  StoreStats s;
  s.block_bytes = pool_->block_bytes();
  s.dram_slots = pool_->num_slots();
  s.dram_used = pool_->num_slots() - pool_->free_slots();
  s.disk_extents = disk_ ? disk_->num_extents() : 0;
  s.disk_used = disk_ ? disk_->num_extents() - disk_->free_extents() : 0;
  s.blocks = index_.size();
  s.pinned = index_.pinned_blocks();
  const Counters& c = *c_;
  s.puts = c.puts, s.put_dedup = c.put_dedup, s.bytes_put = c.bytes_put;
  s.hits_dram = c.hits_dram, s.hits_disk = c.hits_disk, s.misses = c.misses, s.bytes_got = c.bytes_got;
  s.evictions = c.evictions, s.demotions = c.demotions, s.promotions = c.promotions;
  s.disk_evictions = c.disk_evictions;
  s.corruptions = c.corruptions, s.disk_write_errors = c.disk_write_errors, s.disk_read_errors = c.disk_read_errors;
  s.dropped = c.dropped;
  s.recovered_dram = c.recovered_dram, s.recovered_disk = c.recovered_disk;
  s.waiting_writers = waiting_writers_;
  s.hugepages = pool_->hugepages(), s.mlocked = pool_->mlocked(), s.direct_io = disk_ && disk_->direct_io();
  s.hits_shared = c.hits_shared;
  if (shared_) {
    s.shared_enabled = true;
    s.shared = shared_->Stats();
    s.corruptions += s.shared.corruptions;
  }
  s.last_error = c.last_error;
  return s;
}

// ---- zero-copy leases -------------------------------------------------------------------

Result<WriteLease> StoreImpl::Reserve(const BlockKey& key, bool wait) {
  std::unique_lock lock(mu_);
  // Without `wait`, write-behinds (which free slots by themselves) are still waited for, but not
  // another lease: a caller holding leases must not wait for others' (no hold-and-wait).
  TPUSYNC_ASSIGN_OR_RETURN(IndexEntry * e, ClaimLocked(lock, key, WriteDeadline(), wait));
  if (e == nullptr) return FailedPrecondition("reserve: block " + key.ToHex() + " is already stored");
  ++leases_;
  return WriteLease(this, key, e->slot, pool_->data(e->slot), pool_->block_bytes(), pool_->file_offset(e->slot));
}

void StoreImpl::CommitLease(WriteLease& lease, uint64_t length, Status* result) {
  if (length == 0 || length > lease.capacity_) {
    *result = InvalidArgument("commit: length " + std::to_string(length) + " outside 1.." +
                              std::to_string(lease.capacity_));
    return;
  }
  std::lock_guard lock(mu_);
  IndexEntry* e = index_.Find(lease.key_);
  e->writing = false;
  e->length = length;
  --leases_;
  pool_->Commit(lease.slot_, lease.key_, length, ++tick_);
  index_.SetDram(*e, lease.slot_);
  ++c_->puts;
  c_->bytes_put += length;
  QueueSharedLocked(*e);
  MaybeStartWritebackLocked();
  lease.store_ = nullptr;
  cv_.notify_all();
}

void StoreImpl::AbortLease(WriteLease& lease) {
  std::lock_guard lock(mu_);
  pool_->Free(lease.slot_);
  IndexEntry* e = index_.Find(lease.key_);
  e->writing = false;
  e->slot = IndexEntry::kNoLocation;
  if (e->pins == 0) index_.Erase(lease.key_);  // a pinned entry keeps its pins for the next writer
  --leases_;
  cv_.notify_all();
}

Result<ReadLease> StoreImpl::Acquire(const BlockKey& key) {
  std::unique_lock lock(mu_);
  IndexEntry* e = index_.Find(key);
  while (e != nullptr && e->promoting) {
    cv_.wait(lock);
    e = index_.Find(key);
  }
  // Counted as a get counts them: the sidecar's engines read through leases.
  uint64_t* hit = &c_->hits_dram;
  if ((e == nullptr || e->tier() == Tier::kNone) && shared_ && (e == nullptr || !e->writing)) {
    if (Status st = PromoteSharedLocked(lock, key); !st.ok() && st.code() != StatusCode::kNotFound) {
      ++c_->misses;
      return st;
    }
    e = index_.Find(key);
    hit = &c_->hits_shared;
  }
  if (e == nullptr || e->tier() == Tier::kNone) {
    ++c_->misses;
    return NotFound("acquire: block " + key.ToHex() + " is not stored");
  }
  if (!e->in_dram()) {
    if (Status st = PromoteLocked(lock, *e, nullptr, WriteDeadline()); !st.ok()) {
      ++c_->misses;
      return st;
    }
    e = index_.Find(key);
    hit = &c_->hits_disk;
  }
  ++*hit;
  ++e->dram_readers;
  ++leases_;
  index_.TouchDram(*e);
  return ReadLease(this, key, pool_->data(e->slot), e->length, pool_->file_offset(e->slot));
}

void StoreImpl::ReleaseRead(const BlockKey& key) {
  std::lock_guard lock(mu_);
  IndexEntry* e = index_.Find(key);
  --leases_;
  if (--e->dram_readers == 0) cv_.notify_all();
}

WriteLease::WriteLease(WriteLease&& o) noexcept
    : store_(std::exchange(o.store_, nullptr)), key_(o.key_), slot_(o.slot_), data_(o.data_),
      capacity_(o.capacity_), file_offset_(o.file_offset_) {}

WriteLease::~WriteLease() {
  if (store_ != nullptr) store_->AbortLease(*this);
}

Status WriteLease::Commit(uint64_t length) {
  if (store_ == nullptr) return FailedPrecondition("commit: lease already committed or released");
  Status st = Status::Ok();
  store_->CommitLease(*this, length, &st);
  return st;
}

ReadLease::ReadLease(ReadLease&& o) noexcept
    : store_(std::exchange(o.store_, nullptr)), key_(o.key_), data_(o.data_), size_(o.size_),
      file_offset_(o.file_offset_) {}

ReadLease::~ReadLease() {
  if (store_ != nullptr) store_->ReleaseRead(key_);
}

// ---- the public facade -------------------------------------------------------------------

Store::Store(std::unique_ptr<StoreImpl> impl) : impl_(std::move(impl)) {}
Store::~Store() = default;

Result<std::unique_ptr<Store>> Store::Open(const StoreOptions& options) {
  TPUSYNC_ASSIGN_OR_RETURN(std::unique_ptr<StoreImpl> impl, StoreImpl::Open(options));
  return std::unique_ptr<Store>(new Store(std::move(impl)));
}
Status Store::Put(std::span<const BlockKey> keys, std::span<const ConstBuffer> buffers) {
  return impl_->Put(keys, buffers);
}
Status Store::Get(std::span<const BlockKey> keys, std::span<const MutableBuffer> out, std::span<uint8_t> found) {
  return impl_->Get(keys, out, found);
}
LookupResult Store::Lookup(std::span<const BlockKey> keys, bool pin_prefix) { return impl_->Lookup(keys, pin_prefix); }
Status Store::Pin(std::span<const BlockKey> keys) { return impl_->Pin(keys); }
Status Store::Release(std::span<const BlockKey> keys) { return impl_->Release(keys); }
Status Store::Evict(std::span<const BlockKey> keys) { return impl_->Evict(keys); }
Status Store::Flush() { return impl_->Flush(); }
StoreStats Store::Stats() const { return impl_->Stats(); }
ChangeBatch Store::Changes(ChangeCursor since, std::chrono::milliseconds wait, size_t max_keys) {
  return impl_->feed().Since(since, wait, max_keys);
}
std::vector<Tier> Store::Where(std::span<const BlockKey> keys) { return impl_->Where(keys); }

Status Store::Describe(std::span<const BlockKey> keys, std::span<const std::string> records) {
  SharedTier* shared = impl_->shared();
  if (shared == nullptr) return FailedPrecondition("describe: this store has no shared tier");
  if (keys.size() != records.size()) return InvalidArgument("describe: one record per key");
  for (size_t i = 0; i < keys.size(); ++i) {
    TPUSYNC_RETURN_IF_ERROR(shared->Describe(keys[i], std::as_bytes(std::span(records[i]))));
  }
  return Status::Ok();
}

Result<SharedRecords> Store::Records(std::span<const BlockKey> keys, size_t max_keys) {
  SharedTier* shared = impl_->shared();
  if (shared == nullptr) return FailedPrecondition("records: this store has no shared tier");
  SharedRecords r;
  r.keys = keys.empty() ? shared->Catalog(max_keys) : std::vector<BlockKey>(keys.begin(), keys.end());
  r.records.reserve(r.keys.size());
  for (const BlockKey& k : r.keys) r.records.push_back(shared->Record(k));
  return r;
}
Result<WriteLease> Store::Reserve(const BlockKey& key, bool wait) { return impl_->Reserve(key, wait); }
Result<ReadLease> Store::Acquire(const BlockKey& key) { return impl_->Acquire(key); }
uint64_t Store::block_bytes() const { return impl_->pool().block_bytes(); }
uint32_t Store::num_slots() const { return impl_->pool().num_slots(); }
const std::string& Store::pool_path() const { return impl_->pool().path(); }

}  // namespace tpusync
