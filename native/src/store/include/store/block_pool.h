// BlockPool (private to the store: tpusync/store.h is its interface): a host-DRAM arena of fixed-size blocks in a shared-memory file.
//
// The file (by default under /dev/shm) holds a header, one metadata record per slot and the
// page-aligned slot data. Committed slots record their key, so a process that re-opens the
// file after the writer died finds every committed block again; a slot caught mid-write is
// discarded. One process owns a pool file at a time (an exclusive flock); others may map it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "base/posix_io.h"
#include "store/free_list.h"
#include "tpusync/block_key.h"
#include "tpusync/status.h"
#include "tpusync/types.h"

namespace tpusync {

// A committed slot found when the pool file was re-attached.
struct RecoveredSlot {
  uint32_t slot;
  BlockKey key;
  uint64_t length;
  uint64_t tick;  // last-use tick, to rebuild LRU order
};

class BlockPool {
 public:
  // Creates the file or re-attaches to it. Fails with kFailedPrecondition if another process
  // owns it or its geometry differs from a non-zero request, kInvalidArgument on a bad geometry.
  static Result<std::unique_ptr<BlockPool>> Create(const BlockPoolOptions& options);
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // Takes a free slot and marks it "writing" in shared memory. Thread-safe. nullopt when full.
  std::optional<uint32_t> Allocate();
  // Returns a slot to the free list. The caller must hold no pointer into it afterwards.
  void Free(uint32_t slot);
  // Publishes a fully written slot: its key and length become visible to a re-attaching process.
  void Commit(uint32_t slot, const BlockKey& key, uint64_t length, uint64_t tick);
  // Records a use, so LRU order survives a restart.
  void Touch(uint32_t slot, uint64_t tick);

  std::byte* data(uint32_t slot) const { return data_ + static_cast<size_t>(slot) * block_bytes_; }
  // Byte offset of a slot's data inside the pool file (for processes that map the file).
  uint64_t file_offset(uint32_t slot) const { return data_offset_ + uint64_t{slot} * block_bytes_; }
  uint64_t block_bytes() const { return block_bytes_; }
  uint32_t num_slots() const { return num_slots_; }
  uint32_t free_slots() const { return free_.size(); }
  const std::string& path() const { return path_; }
  // The whole mapping of the pool file: header and slots.
  std::span<std::byte> memory() const { return {static_cast<std::byte*>(base_), file_bytes_}; }
  bool hugepages() const { return hugepages_; }
  bool mlocked() const { return mlocked_; }
  // Committed slots found at open (empty for a new file). Owned by the pool.
  const std::vector<RecoveredSlot>& recovered() const { return recovered_; }

 private:
  struct SlotMeta;
  BlockPool() = default;
  SlotMeta* meta(uint32_t slot) const;

  std::string path_;
  bool unlink_on_close_ = false;
  UniqueFd fd_;  // held open for the flock until the pool closes
  void* base_ = nullptr;
  size_t file_bytes_ = 0;
  std::byte* data_ = nullptr;
  uint64_t data_offset_ = 0;
  uint64_t block_bytes_ = 0;
  uint32_t num_slots_ = 0;
  bool hugepages_ = false;
  bool mlocked_ = false;
  std::vector<RecoveredSlot> recovered_;
  FreeList free_;
};

}  // namespace tpusync
