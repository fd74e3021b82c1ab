#include <algorithm>
#include <cstring>
#include <optional>

#include "base/copy.h"
#include "base/log.h"
#include "base/posix_io.h"
#include "store/store_impl.h"

namespace tpusync {

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

}  // namespace tpusync
