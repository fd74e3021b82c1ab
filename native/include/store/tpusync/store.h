// Store: the host's block store. A shared-memory DRAM pool in front of an optional disk tier
// and an optional shared tier (a filesystem every host of the pool mounts).
//
// put copies blocks into DRAM slots; when DRAM runs low, the least recently used unpinned
// blocks are written behind to disk by background threads and their slots reused. get copies
// blocks out, promoting disk blocks back into DRAM after verifying their checksums. A block in
// neither is looked for on the shared tier, where any host may have written it, and promoted
// into DRAM when found. The shared tier receives every committed block (write-through) or the
// blocks that leave DRAM (demote), written by the same background threads. Every method is
// thread-safe. Long calls do their copies and file I/O without holding the lock.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tpusync/block_key.h"
#include "tpusync/status.h"
#include "tpusync/types.h"

namespace tpusync {

class StoreImpl;

// A DRAM slot reserved for one key, written in place (no copy), then committed.
// Destroying an uncommitted lease releases the slot. Must not outlive its Store.
class WriteLease {
 public:
  WriteLease(WriteLease&& o) noexcept;
  WriteLease& operator=(WriteLease&&) = delete;
  ~WriteLease();
  std::byte* data() const { return data_; }
  size_t capacity() const { return capacity_; }
  uint64_t file_offset() const { return file_offset_; }
  const BlockKey& key() const { return key_; }
  // Publishes the first `length` bytes as the block. kFailedPrecondition if already done.
  Status Commit(uint64_t length);

 private:
  friend class StoreImpl;
  WriteLease(StoreImpl* s, BlockKey k, uint32_t slot, std::byte* d, size_t cap, uint64_t off)
      : store_(s), key_(k), slot_(slot), data_(d), capacity_(cap), file_offset_(off) {}
  StoreImpl* store_;
  BlockKey key_;
  uint32_t slot_;
  std::byte* data_;
  size_t capacity_;
  uint64_t file_offset_;
};

// A resident block held in DRAM for reading in place; it cannot be evicted while held.
class ReadLease {
 public:
  ReadLease(ReadLease&& o) noexcept;
  ReadLease& operator=(ReadLease&&) = delete;
  ~ReadLease();
  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  uint64_t file_offset() const { return file_offset_; }

 private:
  friend class StoreImpl;
  ReadLease(StoreImpl* s, BlockKey k, const std::byte* d, size_t n, uint64_t off)
      : store_(s), key_(k), data_(d), size_(n), file_offset_(off) {}
  StoreImpl* store_;
  BlockKey key_;
  const std::byte* data_;
  size_t size_;
  uint64_t file_offset_;
};

class Store {
 public:
  // Opens (or re-attaches to) the pool file and the disk directory and rebuilds the index
  // from what they hold.
  static Result<std::unique_ptr<Store>> Open(const StoreOptions& options);
  // Stops the write-behind threads. Blocks still queued for demotion stay in DRAM.
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Stores each buffer (1..block_bytes bytes) under its key. A key already present is left
  // as it is (blocks are content-addressed); a key another caller is writing is waited for
  // (up to write_wait) and written here if that caller gives up. OK means every block is
  // readable now. kResourceExhausted if DRAM is full of pinned or in-use blocks,
  // kUnavailable if another writer held a key past write_wait; blocks stored before the
  // failure stay stored.
  Status Put(std::span<const BlockKey> keys, std::span<const ConstBuffer> buffers);
  // Copies each present block into its output buffer and sets found[i]. A disk block that
  // fails verification is reported (stats, log), dropped and counted as a miss, and so is a
  // block shorter than its buffer (found never leaves part of a buffer stale).
  // kInvalidArgument if an output buffer is smaller than its block.
  Status Get(std::span<const BlockKey> keys, std::span<const MutableBuffer> out, std::span<uint8_t> found);
  // The tier of each key and the length of the present prefix; pins the prefix if asked. The
  // shared tier is asked only about keys of the prefix that neither DRAM nor disk holds (its
  // other keys read kNone when absent locally).
  LookupResult Lookup(std::span<const BlockKey> keys, bool pin_prefix);
  // The tier of every key, the shared tier asked about each key that neither DRAM nor disk
  // holds (Lookup asks it only up to the prefix's end), by an open that a network filesystem
  // revalidates (the tier's Exists): where an announcer's blocks are now.
  std::vector<Tier> Where(std::span<const BlockKey> keys);
  // Pins keep blocks from eviction until released. Both check every key before changing any:
  // kNotFound (pin) or kFailedPrecondition (release of an unpinned key) name the first bad one.
  Status Pin(std::span<const BlockKey> keys);
  Status Release(std::span<const BlockKey> keys);
  // Pushes blocks one tier down and returns when done: DRAM -> disk (through the write-behind
  // threads; dropped without a disk tier), disk -> gone. With the demote policy a block leaving
  // DRAM is written to the shared tier first. The shared tier's own files are left to its
  // evictor. Reports the first demotion error.
  Status Evict(std::span<const BlockKey> keys);
  // Waits for queued write-behind (to disk and to the shared tier); returns the first demotion
  // error since the last Flush. Failed shared-tier writes are counted, not returned: the
  // block stays readable where it was.
  Status Flush();
  StoreStats Stats() const;
  // The keys whose tier changed after `since` (a ChangeFeed's Since): a block that entered or
  // left DRAM or the disk, or a shared-tier file this store removed (evicted, damaged).
  ChangeBatch Changes(ChangeCursor since, std::chrono::milliseconds wait, size_t max_keys);
  // The shared tier's block records (the tier's Describe and Record): written by the
  // engine that stored a block, read by every host's. Records of `keys`, or with no keys the
  // catalog: the blocks the tier held at its last scan, most recently read first, at most
  // max_keys. kFailedPrecondition without a shared tier.
  Status Describe(std::span<const BlockKey> keys, std::span<const std::string> records);
  Result<SharedRecords> Records(std::span<const BlockKey> keys, size_t max_keys);

  // Zero-copy access. Reserve: kFailedPrecondition if the key is already stored, kUnavailable
  // if another lease holds it, kResourceExhausted if no slot is free. With `wait`, it first
  // waits up to write_wait for that lease to commit or abort and for a slot to free; without,
  // it waits only for write-behind to free a slot, never for another lease (a caller that holds
  // leases must not wait for others': no hold-and-wait).
  // Acquire: kNotFound if the key is absent.
  Result<WriteLease> Reserve(const BlockKey& key, bool wait = true);
  Result<ReadLease> Acquire(const BlockKey& key);

  // The DRAM pool's geometry and file.
  uint64_t block_bytes() const;
  uint32_t num_slots() const;
  const std::string& pool_path() const;
  // The pool file as mapped in this process (header and slots).
  std::span<std::byte> pool_memory() const;

 private:
  explicit Store(std::unique_ptr<StoreImpl> impl);
  std::unique_ptr<StoreImpl> impl_;
};

}  // namespace tpusync
