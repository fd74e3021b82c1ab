// SharedTier: KV blocks as files on a filesystem that every host of a pool mounts (Managed
// Lustre, Filestore, GCS FUSE, NFS), written once by any host and read by all.
//
// No lock is ever taken across hosts. Each block is one immutable file, written to a temporary
// name and published by rename, so readers see a whole file or none; two hosts writing the same
// key publish the same bytes (keys are content addresses) and the last rename wins.
//
// Trust: the directory is writable by more than the pool (other pods on the filesystem, other
// pools), so nothing in it is believed without the pool's secret. Every block and record
// carries AES-256-GMAC tags under keys derived from the secret; a file whose tags fail is a
// miss, never a block (not read, not counted by a lookup, not announced). The pool's directory
// and each layout's are named by keyed digests, so two pools on one filesystem never meet, and
// engines that disagree on anything that changes a block's bytes (the block size and the layout
// string the engine supplies: model, dtype, parallel sizes, rank) never read each other's
// blocks. Below the configured directory no link is ever followed: every name is resolved
// beneath a directory fd opened once, and an entry of the wrong type is skipped, logged once,
// never deleted through, never announced.
//
//   <dir>/tpusync-shared-v2/<pool>/<fingerprint>/layout          the layout's inputs, as text (for people)
//   <dir>/tpusync-shared-v2/<pool>/<fingerprint>/<kk>/<key>      one block: a 4 KiB tagged header,
//                                                                the payload padded to 4 KiB
//   <dir>/tpusync-shared-v2/<pool>/<fingerprint>/records/<kk>/<key>   a block's record (below)
//   <dir>/tpusync-shared-v2/<pool>/<fingerprint>/pins/<key>.<instance>   a host's pin of a block
//   <dir>/tpusync-shared-v2/<pool>/<fingerprint>/tmp/            files being written or evicted
//
// The directory is the index: a lookup is an open and, for a file not seen before, a read of
// its header page. Every read verifies both tags; a torn, truncated, corrupted or forged file
// is a miss, removed and counted. Capacity is the tier's own: an evictor on every host deletes
// the least recently read files of the pool (by access time, which a hit sets explicitly, so
// the order is the pool's, not one host's) from the high watermark down to the low one. An
// evictor skips the blocks pinned when its pass starts, renames its victims aside, then reads
// the pin markers again and puts back any victim pinned meanwhile; a pinning host creates its
// marker before checking that the block exists. Either the pin sees the block gone, or the
// evictor sees the pin. A read of a block this host pinned that finds it aside waits for the
// evictor to put it back (kPinnedReadWait at most), so a pinned block is always readable.
//
// A block may have a record: a small, opaque, tagged description that its engine supplies (for
// KV events: the block's tokens and parent), so that every host can announce blocks that any
// host wrote. Records are immutable like blocks and leave with them. Each scan (the evictor's
// pass) also diffs the layout's verified blocks against the previous scan, so a host learns
// within a pass which blocks other hosts published or removed (`on_changed`).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "tpusync/block_key.h"
#include "tpusync/status.h"
#include "tpusync/types.h"

namespace tpusync {

class SharedTier {
 public:
  // How long a read waits for a block this host pinned to come back from an evictor's aside.
  static constexpr std::chrono::milliseconds kPinnedReadWait{2000};

  // kInvalidArgument without the secret or with bad sizes; kFailedPrecondition when an entry of
  // the tier's own tree is a link or a file where a directory belongs.
  static Result<std::unique_ptr<SharedTier>> Open(const SharedTierOptions& options);
  ~SharedTier();  // stops the evictor; removes this instance's pin markers
  SharedTier(const SharedTier&) = delete;
  SharedTier& operator=(const SharedTier&) = delete;

  // Publishes a block. `src` is page-aligned and readable for AlignUp(length, 4096) bytes.
  // OK when the block is on the tier (written here, or a file whose header verifies found
  // there already; a file that does not verify is replaced). kResourceExhausted when the
  // filesystem (or the tier's capacity) cannot hold it: nothing is left behind. Thread-safe.
  Status Write(const BlockKey& key, const std::byte* src, uint64_t length);
  // Reads and verifies a block into `dst` (page-aligned, `capacity` bytes, at least the
  // block's length rounded up to 4096); returns its length. kNotFound if absent, kDataLoss if
  // the file is damaged or forged (then removed), kInvalidArgument if the block is larger than
  // capacity. A block pinned here and absent is waited for: an evictor has it aside.
  Result<uint64_t> Read(const BlockKey& key, std::byte* dst, uint64_t capacity);
  // Whether the tier holds the block: a regular file whose header verifies (its payload is
  // verified at the read). Asked of the file server by an open, which NFS and FUSE revalidate
  // (a stat may answer from an attribute cache for seconds after another host removed it).
  bool Exists(const BlockKey& key);
  // Keeps a block from every host's evictor until Release. kNotFound if it is not on the tier.
  // Pins are counted per key in this process; one marker file per key and instance.
  Status Pin(const BlockKey& key);
  void Release(const BlockKey& key);

  // A block's record: written once (a record already there and verifying is kept; records,
  // like blocks, are content-addressed), before or after the block itself; one whose block
  // never appears is removed after pin_ttl, by a pass over its directory (one of 256 a pass).
  // kInvalidArgument if empty or over kMaxRecordBytes.
  Status Describe(const BlockKey& key, std::span<const std::byte> record);
  // The record of a block, verified; empty if there is none (or it failed: then removed).
  std::string Record(const BlockKey& key);
  // This layout's verified blocks as of the last scan, most recently read first, at most `max`.
  std::vector<BlockKey> Catalog(size_t max) const;

  // One pass now (eviction over every layout of the pool, and this layout's catalog); returns
  // the files evicted. The evictor thread runs the same pass every evict_interval.
  Result<uint64_t> EvictOnce();

  SharedTierStats Stats() const;
  const std::string& root() const { return root_; }  // this layout's directory
  bool direct_io() const { return direct_io_; }
  uint64_t block_bytes() const { return block_bytes_; }

 private:
  struct Files;  // the keys and the directories opened once (store/shared_files.h)
  struct Scan;      // what one pass found (shared_evict.cc)
  struct Eviction;  // what one pass took aside and deleted (shared_evict.cc)
  struct FileId {  // a file as a header check saw it; any change means check again
    uint64_t ino, size;
    int64_t mtime_ns, ctime_ns;
    bool operator==(const FileId&) const = default;
  };
  SharedTier();
  Status Refuse(uint64_t file_bytes);
  void Remove(const BlockKey& key, uint64_t ino, const std::string& why);
  void Damaged(const std::string& why);  // counted, logged at the 1st, 2nd, 4th, ...
  void Skipped(const std::string& path, const std::string& why);  // counted; logged once a path
  // Whether the open regular file `fd` (seen as `id`) holds `key`'s block: its header verifies.
  // Cached by FileId, so a scan or lookup reads a header page once per file.
  bool HeaderVerifies(const BlockKey& key, int fd, const FileId& id);
  bool Verified(const BlockKey& key, const FileId& id) const;
  void Changed(const BlockKey& key) const {
    if (options_.on_changed) options_.on_changed(key);
  }
  void EvictLoop(const std::stop_token& stop);
  void RefreshPins();
  bool PinnedHere(const BlockKey& key) const;
  std::string PinName(const BlockKey& key) const;
  // The pass, in steps: what is there, how much to free, in which order, taking it, and the
  // catalog that is left.
  Scan ScanPool(int64_t now_s, int64_t ttl_s);
  uint64_t Excess(uint64_t used) const;
  std::vector<size_t> Choose(const Scan& scan, uint64_t excess) const;
  Eviction TakeAside(const Scan& scan, std::span<const size_t> order, uint64_t excess, int64_t now_s, int64_t ttl_s);
  void UpdateCatalog(Scan& scan, const Eviction& ev);
  template <typename T>
  void Count(T SharedTierStats::* field, T by = 1) {
    std::lock_guard lock(mu_);
    stats_.*field += by;
  }

  SharedTierOptions options_;
  std::unique_ptr<Files> files_;
  std::string root_;      // this layout's directory, for messages and tests
  std::string instance_;  // names this process's temporary files and pin markers
  uint64_t block_bytes_ = 0;
  uint64_t capacity_ = 0;
  bool direct_io_ = false;
  std::atomic<uint64_t> temp_seq_{0};

  std::mutex pin_mu_;  // one Pin at a time: creating a marker and finding the block are one step
  mutable std::mutex mu_;
  SharedTierStats stats_;                                              // guarded by mu_
  std::unordered_map<BlockKey, uint32_t, BlockKeyHash> pins_;          // guarded by mu_
  std::unordered_set<std::string> skipped_;                            // guarded by mu_: logged once each
  std::vector<BlockKey> catalog_;  // guarded by mu_: the last scan's blocks, most recently read first
  std::mutex scan_mu_;             // one pass at a time: each diffs against the one before
  bool scanned_ = false;           // guarded by scan_mu_
  uint32_t orphan_sweep_ = 0;      // guarded by scan_mu_: the records directory this pass checks
  std::jthread evictor_;
};

}  // namespace tpusync
