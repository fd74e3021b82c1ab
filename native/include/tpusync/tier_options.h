// The options of the store's DRAM pool and disk tier (StoreOptions holds them); the tiers
// themselves are the store's own (src/store/include/store).
#pragma once

#include <cstdint>
#include <string>

namespace tpusync {

struct BlockPoolOptions {
  std::string path;          // shared-memory file; created if absent, re-attached if present
  uint64_t block_bytes = 0;  // multiple of 4096; 0 = take it from an existing file
  uint64_t num_slots = 0;    // 0 = take it from an existing file
  bool hugepages = false;    // ask for transparent huge pages (madvise); best effort
  bool mlock = false;        // lock the arena in RAM; best effort (needs RLIMIT_MEMLOCK)
  bool populate = true;      // pre-fault every page at open so the first copy runs at memcpy speed
  bool unlink_on_close = false;
};

struct DiskTierOptions {
  std::string dir;              // created if absent
  uint64_t capacity_bytes = 0;  // payload bytes; rounded down to whole extents
  uint64_t block_bytes = 0;     // multiple of 4096, same as the DRAM pool's
  bool direct_io = true;        // falls back to buffered I/O where O_DIRECT is refused
};

}  // namespace tpusync
