#include "store/block_index.h"

namespace tpusync {

Tier IndexEntry::tier() const {
  if (in_dram() && on_disk()) return Tier::kDramAndDisk;
  if (in_dram()) return Tier::kDram;
  if (on_disk()) return Tier::kDisk;
  return Tier::kNone;
}

bool IndexEntry::dram_evictable() const {
  return in_dram() && pins == 0 && dram_readers == 0 && !demoting && !promoting && !shared_queued;
}

bool IndexEntry::disk_evictable() const {
  return on_disk() && pins == 0 && disk_readers == 0 && !promoting;
}

IndexEntry* BlockIndex::Find(const BlockKey& key) {
  auto it = map_.find(key);
  return it == map_.end() ? nullptr : &it->second;
}

IndexEntry& BlockIndex::Insert(const BlockKey& key) {
  auto [it, inserted] = map_.try_emplace(key);
  if (inserted) it->second.key = key;
  return it->second;
}

void BlockIndex::Erase(const BlockKey& key) {
  auto it = map_.find(key);
  if (it == map_.end()) return;
  ClearDram(it->second);
  ClearDisk(it->second);
  if (it->second.pins > 0) --pinned_;
  const BlockKey erased = key;  // `key` may be the erased entry's own
  map_.erase(it);
  Changed(erased);
}

void BlockIndex::SetDram(IndexEntry& e, uint32_t slot) {
  e.slot = slot;
  TouchDram(e);
  Changed(e.key);
}

void BlockIndex::TouchDram(IndexEntry& e) {
  if (e.in_dram_lru_) dram_lru_.erase(e.dram_lru_);
  dram_lru_.push_front(e.key);
  e.dram_lru_ = dram_lru_.begin();
  e.in_dram_lru_ = true;
}

void BlockIndex::ClearDram(IndexEntry& e) {
  if (e.in_dram_lru_) dram_lru_.erase(e.dram_lru_);
  if (e.slot != IndexEntry::kNoLocation) Changed(e.key);
  e.in_dram_lru_ = false;
  e.slot = IndexEntry::kNoLocation;
}

void BlockIndex::SetDisk(IndexEntry& e, uint32_t extent) {
  if (e.in_disk_lru_) disk_lru_.erase(e.disk_lru_);
  e.extent = extent;
  disk_lru_.push_front(e.key);
  e.disk_lru_ = disk_lru_.begin();
  e.in_disk_lru_ = true;
  Changed(e.key);
}

void BlockIndex::ClearDisk(IndexEntry& e) {
  if (e.in_disk_lru_) disk_lru_.erase(e.disk_lru_);
  if (e.extent != IndexEntry::kNoLocation) Changed(e.key);
  e.in_disk_lru_ = false;
  e.extent = IndexEntry::kNoLocation;
}

IndexEntry* BlockIndex::DramVictim() {
  for (auto it = dram_lru_.rbegin(); it != dram_lru_.rend(); ++it) {
    IndexEntry& e = map_.find(*it)->second;
    if (e.dram_evictable()) return &e;
  }
  return nullptr;
}

IndexEntry* BlockIndex::DiskVictim() {
  for (auto it = disk_lru_.rbegin(); it != disk_lru_.rend(); ++it) {
    IndexEntry& e = map_.find(*it)->second;
    if (e.disk_evictable()) return &e;
  }
  return nullptr;
}

}  // namespace tpusync
