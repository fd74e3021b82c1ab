// BlockStore: the one contract of a block store, whichever backend serves it.
//
// Three implementations (made by the factories in tpusync/net/block_stores.h):
//   - the local store: a Store in this process, plus connections to peers' data ports;
//   - the sidecar client: the sidecar of this pod over its UNIX control socket, blocks copied
//     through the sidecar's shared-memory pool, which the client maps;
//   - the data-port client: a remote sidecar's authenticated data port. It has no pool of
//     its own: the operations that need one (pins, slots, eviction, transfers between peers)
//     return kFailedPrecondition saying so.
// Callers hold a BlockStore and never ask which one it is; an operation a backend cannot do
// is a Status, not a type check. Every method is thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tpusync/block_key.h"
#include "tpusync/status.h"
#include "tpusync/types.h"

namespace tpusync {

// A block's bytes in a pool this process maps: a reserved slot (writable, `size` is its
// capacity) or an acquired block (read-only, `size` is its length). data == nullptr: no slot
// for this key (reserve: already stored; acquire: absent). Valid until the key is committed,
// aborted or unacquired, and never after Close().
struct BlockSlot {
  std::byte* data = nullptr;
  uint64_t size = 0;
  uint64_t file_offset = 0;  // of the slot in the pool file, for other processes mapping it
};

// What a pull left behind, per key: held[i] is kBlockAbsent, kBlockHeld (stored before, or by
// another writer meanwhile) or kBlockLanded (arrived in this pull; when digests were asked
// for, digests[i] is then the XXH3-64 of the bytes as they landed; 0 otherwise).
enum BlockHeld : uint8_t { kBlockAbsent = 0, kBlockHeld = 1, kBlockLanded = 2 };
struct PullReport {
  std::vector<uint8_t> held;
  std::vector<uint64_t> digests;
};

class BlockStore {
 public:
  virtual ~BlockStore() = default;

  // Store's contracts (tpusync/store.h) for Put, Get, Lookup, Evict and Flush.
  virtual Status Put(std::span<const BlockKey> keys, std::span<const ConstBuffer> buffers) = 0;
  virtual Status Get(std::span<const BlockKey> keys, std::span<const MutableBuffer> out,
                     std::span<uint8_t> found) = 0;
  virtual Result<LookupResult> Lookup(std::span<const BlockKey> keys, bool pin_prefix) = 0;
  // Pins keep blocks from eviction until released; all keys are checked before any changes.
  // Through the sidecar a pin belongs to this client's session (dropped when it closes) unless
  // `for_host`, which keeps it until some client releases it for_host. A local store's pins
  // are all the host's: `for_host` changes nothing there.
  virtual Status Pin(std::span<const BlockKey> keys, bool for_host) = 0;
  virtual Status Release(std::span<const BlockKey> keys, bool for_host) = 0;
  virtual Status Evict(std::span<const BlockKey> keys) = 0;
  virtual Status Flush() = 0;
  // Counters of the store behind this backend. Fields a backend cannot observe stay zero
  // (the sidecar does not report its mapping flags; the data port reports only block_bytes).
  virtual Result<StoreStats> Stats() = 0;
  // Store::Changes: the keys whose tier changed since `since`, waiting up to `wait` (at most
  // net::kMaxChangesWaitMs) for one. Through the sidecar the wait holds the client's channel:
  // poll on a client of its own. kFailedPrecondition on the data port (no store to watch).
  virtual Result<ChangeBatch> Changes(ChangeCursor since, std::chrono::milliseconds wait, size_t max_keys) = 0;
  // Store::Where: the tier of every key, the shared tier asked about each (on the data port,
  // the peer's EXISTS: its shared tier asked up to the prefix's end). Store::Describe and
  // Store::Records: the shared tier's block records; kFailedPrecondition on the data port.
  virtual Result<std::vector<Tier>> Where(std::span<const BlockKey> keys) = 0;
  virtual Status Describe(std::span<const BlockKey> keys, std::span<const std::string> records) = 0;
  virtual Result<SharedRecords> Records(std::span<const BlockKey> keys, size_t max_keys) = 0;

  // Zero-copy slots, batched. Reserve is all or nothing: a slot per key not yet stored (null
  // for stored ones), or kResourceExhausted (no free slot for every key) or kUnavailable
  // (another writer holds one of the keys) with nothing left reserved. It waits for a slot or
  // another writer only while this client holds no reservation (no hold-and-wait).
  // Commit publishes the first lengths[i] bytes of each reserved slot; Abort gives slots back.
  // Acquire holds present blocks in DRAM (null slots for absent ones) until Unacquire, once
  // per Acquire of the key. kFailedPrecondition where no pool is mapped here.
  virtual Result<std::vector<BlockSlot>> Reserve(std::span<const BlockKey> keys) = 0;
  virtual Status Commit(std::span<const BlockKey> keys, std::span<const uint64_t> lengths) = 0;
  virtual Status Abort(std::span<const BlockKey> keys) = 0;
  virtual Result<std::vector<BlockSlot>> Acquire(std::span<const BlockKey> keys) = 0;
  virtual Status Unacquire(std::span<const BlockKey> keys) = 0;

  // Transfers between this store and a peer's data port ("host:port"). PullFrom fetches only
  // the blocks this store lacks; a peer failing part-way returns its error after the blocks
  // that arrived whole were kept. PushTo: result[i] != 0 when the peer holds block i
  // afterwards. ExistsAt: the peer's tier of each key; nothing moves.
  virtual Result<PullReport> PullFrom(const std::string& peer, std::span<const BlockKey> keys, bool digests) = 0;
  virtual Result<std::vector<uint8_t>> PushTo(const std::string& peer, std::span<const BlockKey> keys) = 0;
  virtual Result<std::vector<Tier>> ExistsAt(const std::string& peer, std::span<const BlockKey> keys) = 0;

  virtual uint64_t block_bytes() const = 0;
  // The shared-memory pool file behind the store; empty for the data-port client.
  virtual const std::string& pool_path() const = 0;
  // That pool as mapped in this process (every slot's view lies in it), to register it with a
  // device runtime as page-locked host memory; empty for the data-port client.
  virtual std::span<std::byte> pool_memory() const = 0;
  // Ends the session: the sidecar drops this client's pins and leases, the local store gives
  // back slots still reserved or acquired and stops its write-behind threads. Later calls
  // return kUnavailable or kFailedPrecondition. Idempotent. The caller must not run other
  // calls on this object concurrently with Close.
  virtual void Close() = 0;
};

}  // namespace tpusync
