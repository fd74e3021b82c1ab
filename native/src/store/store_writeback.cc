#include <algorithm>
#include <cstring>
#include <optional>

#include "base/copy.h"
#include "base/log.h"
#include "base/posix_io.h"
#include "store/store_impl.h"

namespace tpusync {

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

}  // namespace tpusync
