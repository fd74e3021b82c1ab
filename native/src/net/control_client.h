// SidecarClient: an engine's handle on the sidecar in its pod. It maps the sidecar's pool
// file and copies blocks in and out itself; the control channel only hands out slots.
#pragma once

#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "net/conn.h"
#include "posix_io.h"
#include "tpusync/store.h"

namespace tpusync::net {

class SidecarClient {
 public:
  static Result<std::unique_ptr<SidecarClient>> Connect(const std::string& socket_path,
                                                        std::chrono::milliseconds timeout);

  // Same contracts as Store's methods of the same names.
  Status Put(std::span<const BlockKey> keys, std::span<const ConstBuffer> buffers);
  Status Get(std::span<const BlockKey> keys, std::span<const MutableBuffer> out, std::span<uint8_t> found);
  Result<LookupResult> Lookup(std::span<const BlockKey> keys, bool pin_prefix);
  // Pins belong to this client's connection (dropped when it closes) unless `for_host`:
  // those stay until some client releases them for_host (e.g. the weights' current version).
  Status Pin(std::span<const BlockKey> keys, bool for_host = false);
  Status Release(std::span<const BlockKey> keys, bool for_host = false);
  Status Evict(std::span<const BlockKey> keys);
  Status Flush();
  Result<std::string> Stats();
  // Asks the sidecar to pull from / push to a peer ("host:port"). result[i] != 0 when block i
  // is held locally (pull) or by the peer (push) afterwards; exists gives the peer's tiers.
  // A pull reports kLanded (2) for the blocks that arrived in it, and with `digests` the
  // XXH3-64 of each of those as it landed (0 for the others), so a caller can check them
  // against known checksums without reading the blocks again.
  Result<std::vector<uint8_t>> PullFrom(const std::string& peer, std::span<const BlockKey> keys,
                                        std::vector<uint64_t>* digests = nullptr);
  Result<std::vector<uint8_t>> PushTo(const std::string& peer, std::span<const BlockKey> keys);
  Result<std::vector<uint8_t>> ExistsAt(const std::string& peer, std::span<const BlockKey> keys);

  // Zero-copy access for engines that lay blocks out themselves (e.g. gathering a KV page
  // straight from a device buffer into its slot). Reserve returns one slot per key (code
  // kSlotOk and a pointer into the mapped pool, or why not); Commit publishes reserved
  // slots; Acquire holds present blocks in DRAM until Unacquire.
  struct SlotView {
    uint8_t code;
    std::byte* data;
    uint64_t size;
  };
  Result<std::vector<SlotView>> Reserve(std::span<const BlockKey> keys);
  Status Commit(std::span<const BlockKey> keys, std::span<const uint64_t> lengths);
  Status Abort(std::span<const BlockKey> keys);
  Result<std::vector<SlotView>> Acquire(std::span<const BlockKey> keys);
  Status Unacquire(std::span<const BlockKey> keys);

  // Ends the session and returns once the sidecar has dropped this client's pins and leases.
  // The pool stays mapped until the client is destroyed, so earlier views remain valid memory.
  void Close();

  uint64_t block_bytes() const { return block_bytes_; }
  const std::string& pool_path() const { return pool_path_; }

 private:
  Result<std::vector<SlotView>> Views(Op op, std::span<const BlockKey> keys);
  SidecarClient() = default;
  Result<Frame> Call(Op op, std::span<const std::byte> body, uint32_t count, uint16_t status = 0);
  Result<Frame> CallKeys(Op op, std::span<const BlockKey> keys, uint16_t status = 0);
  Result<std::vector<uint8_t>> PeerCall(Op op, const std::string& peer, std::span<const BlockKey> keys,
                                        std::vector<uint64_t>* digests = nullptr);
  struct Slot {
    uint8_t code;
    uint64_t offset, size;
  };
  Result<std::vector<Slot>> Slots(Op op, std::span<const BlockKey> keys);
  Status PutBatch(std::span<const BlockKey> keys, std::span<const ConstBuffer> buffers);
  Status GetBatch(std::span<const BlockKey> keys, std::span<const MutableBuffer> out, std::span<uint8_t> found);

  std::chrono::milliseconds timeout_{};
  std::mutex mu_;  // one request at a time on the channel
  Socket socket_;
  std::unique_ptr<FramedConn> conn_;
  Mapping pool_;
  std::string pool_path_;
  uint64_t block_bytes_ = 0;
  size_t batch_ = 1;  // keys per reserve/acquire round trip: leases pin slots, so a batch must fit
};

}  // namespace tpusync::net
