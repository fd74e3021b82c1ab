// The store's value types: what its callers pass and get back (options, results, statistics,
// tiers, change cursors). The tiers themselves are the store's own (src/store/include/store/);
// the public headers include this file, never a tier's.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "tpusync/block_key.h"

namespace tpusync {

// Where a block is, as a bit set: DRAM 1, disk 2. kShared: on the shared tier only (the store
// reports the shared tier for blocks it holds in neither DRAM nor disk).
enum class Tier : uint8_t { kNone = 0, kDram = 1, kDisk = 2, kDramAndDisk = 3, kShared = 4 };

// A tier code from a peer or the sidecar; codes this build does not know read as absent.
inline Tier TierFromCode(uint64_t code) { return code <= 4 ? static_cast<Tier>(code) : Tier::kNone; }

struct ChangeCursor {
  uint64_t epoch = 0;  // names the feed (random per store instance); 0: none yet
  uint64_t seq = 0;    // changes recorded before this one were read
};

struct ChangeBatch {
  ChangeCursor next;           // where the following read starts
  bool lost = false;           // changes were missed: reread every key of interest
  std::vector<BlockKey> keys;  // in the order recorded; a key may repeat
};

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

struct SharedTierOptions {
  std::string dir;               // the mount (or a directory on it); must exist: a missing mount is an error
  std::string secret;            // the pool's secret (16+ bytes): every file is bound to it
  std::string layout;            // what, besides the block size, changes a block's bytes
  uint64_t block_bytes = 0;      // multiple of 4096, same as the DRAM pool's
  uint64_t capacity_bytes = 0;   // the tier's share of the filesystem; 0: the whole filesystem
  double high_watermark = 0.85;  // eviction starts above this fraction of the capacity...
  double low_watermark = 0.70;   // ...and stops at this one
  bool direct_io = true;         // buffered I/O where the filesystem refuses O_DIRECT
  // How often the evictor checks usage; pins older than pin_ttl are a dead host's, ignored.
  std::chrono::milliseconds evict_interval{1000};
  std::chrono::milliseconds pin_ttl{600000};
  bool run_evictor = true;
  // Called (with no lock of the tier held) for each block of this layout that this instance
  // removed (evicted, found damaged), and for each block a scan found published or removed
  // since the previous scan (by any host; not at the first scan). The store's change feed.
  std::function<void(const BlockKey&)> on_changed = nullptr;
};

inline constexpr uint64_t kMaxRecordBytes = 16 << 10;  // a block's record, at most

struct SharedTierStats {
  uint64_t capacity_bytes = 0, used_bytes = 0;  // used: as of the evictor's last scan, plus writes since
  uint64_t writes = 0, write_dedup = 0, bytes_written = 0, write_errors = 0, refused_full = 0;
  uint64_t hits = 0, misses = 0, bytes_read = 0, read_errors = 0;
  uint64_t corruptions = 0;  // files removed whose size, header or tags failed (damaged, or forged)
  uint64_t skipped = 0;      // entries a scan passed over: links, wrong types, sizes or tags
  uint64_t evictions = 0, evicted_bytes = 0, stale_files_removed = 0;
  uint64_t pins_spared = 0;    // victims passed over: pinned when the evictor's pass began
  uint64_t pins_restored = 0;  // victims put back: pinned while the pass had them aside
  uint64_t blocks = 0;  // this layout's blocks at the last scan
  uint64_t write_ns = 0, read_ns = 0;  // time spent in writes and reads that succeeded
  bool direct_io = false;
};

// Every counter of SharedTierStats by name: the sidecar's stats text, /metrics and Python.
inline constexpr std::pair<const char*, uint64_t SharedTierStats::*> kSharedTierCounters[] = {
    {"capacity_bytes", &SharedTierStats::capacity_bytes}, {"used_bytes", &SharedTierStats::used_bytes},
    {"writes", &SharedTierStats::writes},                 {"write_dedup", &SharedTierStats::write_dedup},
    {"bytes_written", &SharedTierStats::bytes_written},   {"write_errors", &SharedTierStats::write_errors},
    {"refused_full", &SharedTierStats::refused_full},     {"hits", &SharedTierStats::hits},
    {"misses", &SharedTierStats::misses},                 {"bytes_read", &SharedTierStats::bytes_read},
    {"read_errors", &SharedTierStats::read_errors},       {"corruptions", &SharedTierStats::corruptions},
    {"evictions", &SharedTierStats::evictions},           {"evicted_bytes", &SharedTierStats::evicted_bytes},
    {"pins_restored", &SharedTierStats::pins_restored},   {"stale_files_removed", &SharedTierStats::stale_files_removed},
    {"pins_spared", &SharedTierStats::pins_spared},
    {"write_ns", &SharedTierStats::write_ns},             {"read_ns", &SharedTierStats::read_ns},
    {"blocks", &SharedTierStats::blocks},                 {"skipped", &SharedTierStats::skipped},
};

enum class SharedPolicy : uint8_t {
  kWriteThrough,  // every committed block is written to the shared tier
  kDemote,        // a block is written there when it leaves DRAM
};

struct StoreOptions {
  BlockPoolOptions pool;
  bool disk_enabled = false;
  DiskTierOptions disk;  // block_bytes is taken from the pool
  bool shared_enabled = false;
  SharedTierOptions shared;  // block_bytes is taken from the pool
  SharedPolicy shared_policy = SharedPolicy::kWriteThrough;
  uint32_t io_threads = 2;  // two: one checksums a block while the other's write is in flight
  // Write-behind starts when fewer than this fraction of DRAM slots are free.
  double writeback_watermark = 0.05;
  // How long a writer waits for another writer of the same key to commit or give up, or for
  // a DRAM slot held by a lease or a write-behind to free, before its call fails.
  std::chrono::milliseconds write_wait{10000};
};

struct ConstBuffer {
  const std::byte* data;
  size_t size;
};

struct MutableBuffer {
  std::byte* data;
  size_t size;
};

struct LookupResult {
  size_t prefix_len = 0;    // leading keys that are present in some tier
  std::vector<Tier> tiers;  // per key
};

// Blocks of the shared tier and their records (SharedTier::Describe); an empty record: none.
struct SharedRecords {
  std::vector<BlockKey> keys;
  std::vector<std::string> records;
};

struct StoreStats {
  uint64_t block_bytes = 0;
  uint64_t dram_slots = 0, dram_used = 0;
  uint64_t disk_extents = 0, disk_used = 0;
  uint64_t blocks = 0, pinned = 0;
  uint64_t puts = 0, put_dedup = 0, bytes_put = 0;
  uint64_t hits_dram = 0, hits_disk = 0, misses = 0, bytes_got = 0;
  uint64_t evictions = 0, demotions = 0, promotions = 0, disk_evictions = 0;
  uint64_t corruptions = 0, disk_write_errors = 0, disk_read_errors = 0;
  // Blocks that left DRAM without reaching disk: a failed or impossible write-behind.
  uint64_t dropped = 0;
  uint64_t recovered_dram = 0, recovered_disk = 0;
  // Writers waiting now: for another writer of their key, or for a DRAM slot to free.
  uint64_t waiting_writers = 0;
  bool hugepages = false, mlocked = false, direct_io = false;
  // The shared tier (all zero without one): hits are blocks a get found only there.
  bool shared_enabled = false;
  uint64_t hits_shared = 0;
  SharedTierStats shared;
  std::string last_error;
};

// Every counter and flag of StoreStats by name (the shared tier's are kSharedTierCounters):
// the sidecar's stats text, its client's parser and Python's stats dict.
inline constexpr std::pair<const char*, uint64_t StoreStats::*> kStoreCounters[] = {
    {"block_bytes", &StoreStats::block_bytes}, {"dram_slots", &StoreStats::dram_slots},
    {"dram_used", &StoreStats::dram_used}, {"disk_extents", &StoreStats::disk_extents},
    {"disk_used", &StoreStats::disk_used}, {"blocks", &StoreStats::blocks},
    {"pinned", &StoreStats::pinned}, {"puts", &StoreStats::puts},
    {"put_dedup", &StoreStats::put_dedup}, {"bytes_put", &StoreStats::bytes_put},
    {"hits_dram", &StoreStats::hits_dram}, {"hits_disk", &StoreStats::hits_disk},
    {"misses", &StoreStats::misses}, {"bytes_got", &StoreStats::bytes_got},
    {"evictions", &StoreStats::evictions}, {"demotions", &StoreStats::demotions},
    {"promotions", &StoreStats::promotions}, {"disk_evictions", &StoreStats::disk_evictions},
    {"corruptions", &StoreStats::corruptions}, {"disk_write_errors", &StoreStats::disk_write_errors},
    {"disk_read_errors", &StoreStats::disk_read_errors}, {"dropped", &StoreStats::dropped},
    {"recovered_dram", &StoreStats::recovered_dram}, {"recovered_disk", &StoreStats::recovered_disk},
    {"waiting_writers", &StoreStats::waiting_writers}, {"hits_shared", &StoreStats::hits_shared},
};
inline constexpr std::pair<const char*, bool StoreStats::*> kStoreFlags[] = {
    {"hugepages", &StoreStats::hugepages}, {"mlocked", &StoreStats::mlocked},
    {"direct_io", &StoreStats::direct_io}, {"shared_enabled", &StoreStats::shared_enabled},
};

}  // namespace tpusync
