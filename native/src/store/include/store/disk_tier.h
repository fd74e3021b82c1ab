// DiskTier (private to the store: tpusync/store.h is its interface): fixed-size extents in one preallocated file, each carrying its own checksummed
// header (magic, key, length, sequence, xxh3 of the payload and of the header).
//
// The headers are the tier's index: opening the directory again scans them and reports every
// valid extent, so the tier survives a restart. Reads verify both checksums; a corrupted or
// truncated extent is reported as kDataLoss and never returned. Writes and reads use O_DIRECT
// where the filesystem supports it, so the page cache does not hold a second copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/posix_io.h"
#include "store/free_list.h"
#include "tpusync/block_key.h"
#include "tpusync/status.h"
#include "tpusync/types.h"

namespace tpusync {

struct RecoveredExtent {
  uint32_t extent;
  BlockKey key;
  uint64_t length;
  uint64_t seq;  // write sequence, to rebuild LRU order
};

class DiskTier {
 public:
  // Opens or creates `dir/extents.dat`. kResourceExhausted when the filesystem cannot hold
  // the capacity; kInvalidArgument on a bad geometry; kFailedPrecondition if another process
  // owns the directory or it was written with a different block size.
  static Result<std::unique_ptr<DiskTier>> Open(const DiskTierOptions& options);
  ~DiskTier();
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  // Extent allocation. Thread-safe. Free erases the extent's header on disk first (one page
  // written), so a freed block never comes back at the next open.
  std::optional<uint32_t> Allocate();
  void Free(uint32_t extent);

  // Writes a block into an extent the caller owns. `src` must be page-aligned and readable for
  // block_bytes (the whole extent is written). Thread-safe for distinct extents.
  Status Write(uint32_t extent, const BlockKey& key, const std::byte* src, uint64_t length, uint64_t seq);
  // Reads and verifies a block. `dst` must be page-aligned and writable for block_bytes.
  // kDataLoss if the header, the key, the length or the payload checksum does not match.
  Status Read(uint32_t extent, const BlockKey& key, uint64_t length, std::byte* dst);

  uint32_t num_extents() const { return num_extents_; }
  uint32_t free_extents() const { return free_.size(); }
  uint64_t block_bytes() const { return block_bytes_; }
  bool direct_io() const { return direct_io_; }
  const std::string& path() const { return path_; }
  // Valid extents found at open, oldest first. Damaged ones are counted in damaged_at_open().
  const std::vector<RecoveredExtent>& recovered() const { return recovered_; }
  uint32_t damaged_at_open() const { return damaged_at_open_; }

 private:
  DiskTier() = default;
  uint64_t offset(uint32_t extent) const;

  std::string path_;
  UniqueFd fd_;
  UniqueFd lock_fd_;  // its flock marks the directory as this process's
  uint64_t block_bytes_ = 0;
  uint32_t num_extents_ = 0;
  bool direct_io_ = false;
  std::vector<RecoveredExtent> recovered_;
  uint32_t damaged_at_open_ = 0;
  FreeList free_;
};

}  // namespace tpusync
