// The data-port BlockStore: a remote sidecar reached over its authenticated data port. Put
// pushes, Get pulls into the caller's buffers, Lookup asks which blocks it holds. No pool is
// mapped here, so what needs one is refused with the reason.
#include <shared_mutex>

#include "net/peer_client.h"
#include "net/put_check.h"
#include "tpusync/net/block_stores.h"

namespace tpusync::net {
namespace {

// Lands pulled blocks straight in the caller's buffers; a buffer too small drops its block
// and is reported after the pull, a block shorter than its buffer is dropped (a miss, never a
// half-stale buffer).
class BufferSink : public BlockSink {
 public:
  explicit BufferSink(std::span<const MutableBuffer> out) : out_(out) {}
  std::byte* Begin(size_t i, uint64_t length) override {
    if (length == out_[i].size) return out_[i].data;
    if (length > out_[i].size) too_small_.store(true);
    return nullptr;
  }
  bool Finish(size_t, uint64_t, bool ok, uint64_t) override { return ok; }
  bool too_small() const { return too_small_.load(); }

 private:
  std::span<const MutableBuffer> out_;
  std::atomic<bool> too_small_{false};  // set from stream threads
};

class BufferSource : public BlockSource {
 public:
  explicit BufferSource(std::span<const ConstBuffer> in) : in_(in) {}
  Result<std::span<const std::byte>> Open(size_t i) override { return std::span(in_[i].data, in_[i].size); }
  void Close(size_t) override {}

 private:
  std::span<const ConstBuffer> in_;
};

Status NoPool(const std::string& what) {
  return FailedPrecondition(what + " needs a local store or the pod's sidecar (unix://): the data-port client "
                                   "(tpusync://) has no pool here to hold it");
}

class DataPortStore final : public BlockStore {
 public:
  explicit DataPortStore(std::unique_ptr<PeerClient> client, PeerOptions options)
      : client_(std::move(client)), block_bytes_(client_->block_bytes()), options_(std::move(options)) {}

  Status Put(std::span<const BlockKey> keys, std::span<const ConstBuffer> buffers) override {
    TPUSYNC_RETURN_IF_ERROR(CheckPutBuffers(keys, buffers, block_bytes_));
    std::shared_lock open(close_mu_);
    TPUSYNC_RETURN_IF_ERROR(Open());
    BufferSource source(buffers);
    std::vector<uint8_t> stored;
    TPUSYNC_RETURN_IF_ERROR(client_->Push(keys, source, Deadline::After(options_.transfer_timeout), stored));
    size_t n = 0;
    for (uint8_t s : stored) n += s != 0 ? 1 : 0;
    if (n != keys.size()) {
      return ResourceExhausted("put: the peer stored " + std::to_string(n) + " of " + std::to_string(keys.size()) +
                               " blocks (DRAM full of pins?)");
    }
    return Status::Ok();
  }
  Status Get(std::span<const BlockKey> keys, std::span<const MutableBuffer> out, std::span<uint8_t> found) override {
    if (keys.size() != out.size() || keys.size() != found.size()) return InvalidArgument("get: sizes differ");
    std::shared_lock open(close_mu_);
    TPUSYNC_RETURN_IF_ERROR(Open());
    BufferSink sink(out);
    std::vector<uint8_t> received;
    TPUSYNC_RETURN_IF_ERROR(client_->Pull(keys, sink, Deadline::After(options_.transfer_timeout), received));
    for (size_t i = 0; i < keys.size(); ++i) found[i] = i < received.size() ? received[i] : 0;
    if (sink.too_small()) return InvalidArgument("get: an output buffer is smaller than its block");
    return Status::Ok();
  }
  Result<LookupResult> Lookup(std::span<const BlockKey> keys, bool pin_prefix) override {
    if (pin_prefix) return NoPool("lookup(pin=True): a pin");
    std::shared_lock open(close_mu_);
    TPUSYNC_RETURN_IF_ERROR(Open());
    LookupResult r;
    TPUSYNC_ASSIGN_OR_RETURN(r.tiers, client_->Exists(keys, Deadline::After(options_.query_timeout)));
    while (r.prefix_len < r.tiers.size() && r.tiers[r.prefix_len] != Tier::kNone) ++r.prefix_len;
    return r;
  }
  Status Pin(std::span<const BlockKey>, bool) override { return NoPool("pin"); }
  Status Release(std::span<const BlockKey>, bool) override { return NoPool("release"); }
  Status Evict(std::span<const BlockKey>) override { return NoPool("evict"); }
  Status Flush() override {  // every put returned after the peer stored it: nothing waits here
    std::shared_lock open(close_mu_);
    return Open();
  }
  Result<StoreStats> Stats() override {
    std::shared_lock open(close_mu_);
    TPUSYNC_RETURN_IF_ERROR(Open());
    StoreStats s;
    s.block_bytes = block_bytes_;
    return s;
  }
  Result<ChangeBatch> Changes(ChangeCursor, std::chrono::milliseconds, size_t) override { return NoPool("changes"); }
  Result<std::vector<Tier>> Where(std::span<const BlockKey> keys) override {  // the peer's EXISTS
    TPUSYNC_ASSIGN_OR_RETURN(LookupResult r, Lookup(keys, false));
    return std::move(r.tiers);
  }
  Status Describe(std::span<const BlockKey>, std::span<const std::string>) override { return NoPool("describe"); }
  Result<SharedRecords> Records(std::span<const BlockKey>, size_t) override { return NoPool("records"); }
  Result<std::vector<BlockSlot>> Reserve(std::span<const BlockKey>) override { return NoPool("reserve"); }
  Status Commit(std::span<const BlockKey>, std::span<const uint64_t>) override { return NoPool("commit"); }
  Status Abort(std::span<const BlockKey>) override { return NoPool("abort"); }
  Result<std::vector<BlockSlot>> Acquire(std::span<const BlockKey>) override { return NoPool("acquire"); }
  Status Unacquire(std::span<const BlockKey>) override { return NoPool("unacquire"); }
  Result<PullReport> PullFrom(const std::string&, std::span<const BlockKey>, bool) override {
    return NoPool("read_remote (a pull from a peer)");
  }
  Result<std::vector<uint8_t>> PushTo(const std::string&, std::span<const BlockKey>) override {
    return NoPool("push_remote (a push to a peer)");
  }
  Result<std::vector<Tier>> ExistsAt(const std::string&, std::span<const BlockKey>) override {
    return NoPool("exists_remote (a query of a peer)");
  }
  uint64_t block_bytes() const override { return block_bytes_; }
  const std::string& pool_path() const override { return no_pool_; }
  std::span<std::byte> pool_memory() const override { return {}; }
  void Close() override {
    std::unique_lock closing(close_mu_);
    client_.reset();
  }

 private:
  Status Open() const {
    return client_ ? Status::Ok() : Status(StatusCode::kUnavailable, "the data-port client is closed");
  }

  std::shared_mutex close_mu_;  // shared by every call, exclusive for Close
  std::unique_ptr<PeerClient> client_;  // null after Close
  const uint64_t block_bytes_;
  const PeerOptions options_;
  const std::string no_pool_;
};

}  // namespace

Result<std::unique_ptr<BlockStore>> ConnectDataPort(const std::string& address, PeerOptions options) {
  if (options.secret.empty()) return InvalidArgument("a data port needs the pool's shared secret");
  TPUSYNC_ASSIGN_OR_RETURN(
      std::unique_ptr<PeerClient> client,
      PeerClient::Connect(address, Secret(options.secret),
                          {.streams = options.streams, .connect_timeout = options.connect_timeout,
                           .encrypt = options.encrypt}));
  return std::unique_ptr<BlockStore>(std::make_unique<DataPortStore>(std::move(client), std::move(options)));
}

}  // namespace tpusync::net
