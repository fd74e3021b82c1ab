#include <algorithm>
#include <cstring>
#include <optional>

#include "base/copy.h"
#include "base/log.h"
#include "base/posix_io.h"
#include "store/store_impl.h"

namespace tpusync {

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

}  // namespace tpusync
