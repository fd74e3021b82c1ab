// BlockIndex: content-addressed map from a block key to where the block lives (DRAM slot,
// disk extent, or both), with one LRU order per tier and capacity accounting.
//
// Victim selection never returns a pinned block, nor one that is being read, written,
// demoted or promoted. Not synchronised: the Store guards it with its mutex.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <unordered_map>
#include <vector>

#include "store/change_feed.h"
#include "tpusync/block_key.h"
#include "tpusync/types.h"

namespace tpusync {

struct IndexEntry {
  static constexpr uint32_t kNoLocation = UINT32_MAX;

  BlockKey key;
  uint64_t length = 0;
  uint32_t slot = kNoLocation;    // DRAM slot, when resident
  uint32_t extent = kNoLocation;  // disk extent, when written
  uint32_t pins = 0;              // user pins: never evicted from any tier while > 0
  uint32_t dram_readers = 0;      // copies out of the slot in flight
  uint32_t disk_readers = 0;      // reads of the extent in flight
  bool writing = false;           // slot allocated, data not yet committed
  bool demoting = false;          // write-behind of the slot to disk in flight
  bool promoting = false;         // read of the extent into a slot in flight
  bool drop_slot_after_demote = false;
  bool on_shared = false;         // this store wrote it to, or read it from, the shared tier
  bool shared_queued = false;     // waiting for its write-through to the shared tier
  uint32_t shared_pins = 0;       // pins held on the shared tier, given back with the last pin
  Tier read_ahead_from = Tier::kNone;  // promoted by a get's read-ahead from this tier, not yet read

  bool in_dram() const { return slot != kNoLocation && !writing; }
  bool on_disk() const { return extent != kNoLocation; }
  Tier tier() const;
  // Free to lose its DRAM copy now (with or without a disk copy).
  bool dram_evictable() const;
  bool disk_evictable() const;

 private:
  friend class BlockIndex;
  std::list<BlockKey>::iterator dram_lru_;
  std::list<BlockKey>::iterator disk_lru_;
  bool in_dram_lru_ = false;
  bool in_disk_lru_ = false;
};

class BlockIndex {
 public:
  IndexEntry* Find(const BlockKey& key);
  // Inserts an empty entry; returns the existing one if the key is present.
  IndexEntry& Insert(const BlockKey& key);
  void Erase(const BlockKey& key);

  // Tier membership. Adding (or touching) moves the block to the most-recent end.
  void SetDram(IndexEntry& e, uint32_t slot);
  void ClearDram(IndexEntry& e);
  void SetDisk(IndexEntry& e, uint32_t extent);
  void ClearDisk(IndexEntry& e);
  void TouchDram(IndexEntry& e);

  // The least recently used evictable block of a tier, or nullptr.
  IndexEntry* DramVictim();
  IndexEntry* DiskVictim();

  size_t size() const { return map_.size(); }
  size_t dram_blocks() const { return dram_lru_.size(); }
  size_t disk_blocks() const { return disk_lru_.size(); }
  size_t pinned_blocks() const { return pinned_; }
  void AdjustPinned(int delta) { pinned_ += delta; }

  // Every change of tier membership (and Changed: a commit, a shared-tier copy) is recorded
  // in `feed` when one is set.
  void set_feed(ChangeFeed* feed) { feed_ = feed; }
  void Changed(const BlockKey& key) {
    if (feed_ != nullptr) feed_->Record(key);
  }

 private:
  ChangeFeed* feed_ = nullptr;
  std::unordered_map<BlockKey, IndexEntry, BlockKeyHash> map_;
  std::list<BlockKey> dram_lru_;  // front = most recent
  std::list<BlockKey> disk_lru_;
  size_t pinned_ = 0;
};

}  // namespace tpusync
