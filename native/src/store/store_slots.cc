#include <algorithm>
#include <cstring>
#include <optional>

#include "base/copy.h"
#include "base/log.h"
#include "base/posix_io.h"
#include "store/store_impl.h"

namespace tpusync {

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

}  // namespace tpusync
