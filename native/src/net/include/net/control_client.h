// SidecarClient: an engine's handle on the sidecar in its pod, a BlockStore. It maps the
// sidecar's pool file and copies blocks in and out itself; the control channel only hands
// out slots.
#pragma once

#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "net/conn.h"
#include "base/posix_io.h"
#include "tpusync/block_store.h"
#include "tpusync/store.h"

namespace tpusync::net {

class SidecarClient final : public BlockStore {
 public:
  static Result<std::unique_ptr<SidecarClient>> Connect(const std::string& socket_path,
                                                        std::chrono::milliseconds timeout);
  ~SidecarClient() override = default;

  // BlockStore's contracts. Blocks are copied into and out of the mapped pool here; the
  // control channel only hands out slots. Transfers with peers run in the sidecar.
  Status Put(std::span<const BlockKey> keys, std::span<const ConstBuffer> buffers) override;
  Status Get(std::span<const BlockKey> keys, std::span<const MutableBuffer> out, std::span<uint8_t> found) override;
  Result<LookupResult> Lookup(std::span<const BlockKey> keys, bool pin_prefix) override;
  Status Pin(std::span<const BlockKey> keys, bool for_host) override;
  Status Release(std::span<const BlockKey> keys, bool for_host) override;
  Status Evict(std::span<const BlockKey> keys) override;
  Status Flush() override;
  Result<StoreStats> Stats() override;
  Result<ChangeBatch> Changes(ChangeCursor since, std::chrono::milliseconds wait, size_t max_keys) override;
  Result<std::vector<Tier>> Where(std::span<const BlockKey> keys) override;
  Status Describe(std::span<const BlockKey> keys, std::span<const std::string> records) override;
  Result<SharedRecords> Records(std::span<const BlockKey> keys, size_t max_keys) override;
  Result<std::vector<BlockSlot>> Reserve(std::span<const BlockKey> keys) override;
  Status Commit(std::span<const BlockKey> keys, std::span<const uint64_t> lengths) override;
  Status Abort(std::span<const BlockKey> keys) override;
  Result<std::vector<BlockSlot>> Acquire(std::span<const BlockKey> keys) override;
  Status Unacquire(std::span<const BlockKey> keys) override;
  Result<PullReport> PullFrom(const std::string& peer, std::span<const BlockKey> keys, bool digests) override;
  Result<std::vector<uint8_t>> PushTo(const std::string& peer, std::span<const BlockKey> keys) override;
  Result<std::vector<Tier>> ExistsAt(const std::string& peer, std::span<const BlockKey> keys) override;
  uint64_t block_bytes() const override { return block_bytes_; }
  const std::string& pool_path() const override { return pool_path_; }
  std::span<std::byte> pool_memory() const override { return {pool_.data(), pool_.size()}; }
  // Returns once the sidecar has dropped this client's pins and leases. The pool stays mapped
  // until the client is destroyed, so earlier views remain valid memory.
  void Close() override;

 private:
  SidecarClient() = default;
  // `wait`: how long the sidecar may take besides the timeout (a long poll).
  Result<Frame> Call(Op op, std::span<const std::byte> body, uint32_t count, uint16_t status = 0,
                     std::chrono::milliseconds wait = {});
  Result<Frame> CallKeys(Op op, std::span<const BlockKey> keys, uint16_t status = 0);
  Result<std::vector<uint8_t>> PeerCall(Op op, const std::string& peer, std::span<const BlockKey> keys,
                                        std::vector<uint64_t>* digests = nullptr);
  struct Slot {
    uint8_t code;
    uint64_t offset, size;
  };
  Result<std::vector<Slot>> Slots(Op op, std::span<const BlockKey> keys);
  // Slots of a reserve or acquire as views into the mapped pool; codes kept in `codes`.
  Result<std::vector<BlockSlot>> Views(Op op, std::span<const BlockKey> keys, std::vector<uint8_t>& codes);
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
