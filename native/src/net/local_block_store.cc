// The local BlockStore: a Store in this process, peers reached through a PeerPool.
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <unordered_map>

#include "net/peer_client.h"
#include "tpusync/net/block_stores.h"

namespace tpusync::net {
namespace {

// PullReport hands PullIntoStore's per-key states through unchanged.
static_assert(uint8_t{kBlockAbsent} == uint8_t{kAbsent} && uint8_t{kBlockHeld} == uint8_t{kHeld} &&
              uint8_t{kBlockLanded} == uint8_t{kLanded});

class LocalBlockStore final : public BlockStore {
 public:
  LocalBlockStore(std::unique_ptr<Store> store, PeerOptions options)
      : store_(std::move(store)),
        pool_path_(store_->pool_path()),
        block_bytes_(store_->block_bytes()),
        options_(std::move(options)) {
    if (!options_.secret.empty()) {
      // The caller names its peers itself: an in-process store dials what it is told to.
      peers_.emplace(Secret(options_.secret),
                     PeerClientOptions{.streams = options_.streams, .connect_timeout = options_.connect_timeout,
                                       .block_bytes = block_bytes_, .encrypt = options_.encrypt},
                     PoolMembers::Anyone());
    }
  }
  ~LocalBlockStore() override { Close(); }

  Status Put(std::span<const BlockKey> keys, std::span<const ConstBuffer> buffers) override {
    std::shared_lock open(close_mu_);
    TPUSYNC_RETURN_IF_ERROR(Open());
    return store_->Put(keys, buffers);
  }
  Status Get(std::span<const BlockKey> keys, std::span<const MutableBuffer> out, std::span<uint8_t> found) override {
    std::shared_lock open(close_mu_);
    TPUSYNC_RETURN_IF_ERROR(Open());
    return store_->Get(keys, out, found);
  }
  Result<LookupResult> Lookup(std::span<const BlockKey> keys, bool pin_prefix) override {
    std::shared_lock open(close_mu_);
    TPUSYNC_RETURN_IF_ERROR(Open());
    return store_->Lookup(keys, pin_prefix);
  }
  Status Pin(std::span<const BlockKey> keys, bool /*for_host: every pin here is the host's*/) override {
    std::shared_lock open(close_mu_);
    TPUSYNC_RETURN_IF_ERROR(Open());
    return store_->Pin(keys);
  }
  Status Release(std::span<const BlockKey> keys, bool /*for_host*/) override {
    std::shared_lock open(close_mu_);
    TPUSYNC_RETURN_IF_ERROR(Open());
    return store_->Release(keys);
  }
  Status Evict(std::span<const BlockKey> keys) override {
    std::shared_lock open(close_mu_);
    TPUSYNC_RETURN_IF_ERROR(Open());
    return store_->Evict(keys);
  }
  Status Flush() override {
    std::shared_lock open(close_mu_);
    TPUSYNC_RETURN_IF_ERROR(Open());
    return store_->Flush();
  }
  Result<StoreStats> Stats() override {
    std::shared_lock open(close_mu_);
    TPUSYNC_RETURN_IF_ERROR(Open());
    return store_->Stats();
  }
  Result<ChangeBatch> Changes(ChangeCursor since, std::chrono::milliseconds wait, size_t max_keys) override {
    std::shared_lock open(close_mu_);
    TPUSYNC_RETURN_IF_ERROR(Open());
    return store_->Changes(since, wait, max_keys);
  }
  Result<std::vector<Tier>> Where(std::span<const BlockKey> keys) override {
    std::shared_lock open(close_mu_);
    TPUSYNC_RETURN_IF_ERROR(Open());
    return store_->Where(keys);
  }
  Status Describe(std::span<const BlockKey> keys, std::span<const std::string> records) override {
    std::shared_lock open(close_mu_);
    TPUSYNC_RETURN_IF_ERROR(Open());
    return store_->Describe(keys, records);
  }
  Result<SharedRecords> Records(std::span<const BlockKey> keys, size_t max_keys) override {
    std::shared_lock open(close_mu_);
    TPUSYNC_RETURN_IF_ERROR(Open());
    return store_->Records(keys, max_keys);
  }

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
  // Empty once closed: the Store's mapping goes with it.
  std::span<std::byte> pool_memory() const override { return store_ ? store_->pool_memory() : std::span<std::byte>{}; }

  // Waits for calls in flight (they hold close_mu_ shared), gives back the slots this object
  // still holds, then closes the Store.
  void Close() override {
    std::unique_lock closing(close_mu_);
    {
      std::lock_guard lock(lease_mu_);
      reserved_.clear();
      acquired_.clear();
    }
    peers_.reset();
    store_.reset();
  }

 private:
  // Call with close_mu_ held (shared).
  Status Open() const { return store_ ? Status::Ok() : FailedPrecondition("the store is closed"); }
  Result<std::shared_ptr<PeerClient>> Peer(const std::string& peer) {
    if (!peers_) {
      return FailedPrecondition("transfers with peers need the pool's shared secret: KVStore.local(secret=...)");
    }
    return peers_->Get(peer);
  }
  // A peer that failed is reconnected on its next use.
  void Failed(const PeerClient& client, const Status& st) {
    if (!st.ok() && peers_) peers_->Forget(client.address());
  }

  // Shared by every call, exclusive for Close: Close waits for the calls in flight.
  std::shared_mutex close_mu_;
  std::unique_ptr<Store> store_;  // null after Close
  const std::string pool_path_;
  const uint64_t block_bytes_;
  const PeerOptions options_;
  std::optional<PeerPool> peers_;  // none without a secret
  std::mutex lease_mu_;
  // Slots this object reserved and has not committed or aborted; blocks it acquired, one
  // entry per Acquire.
  std::unordered_map<BlockKey, WriteLease, BlockKeyHash> reserved_;       // guarded by lease_mu_
  std::unordered_multimap<BlockKey, ReadLease, BlockKeyHash> acquired_;  // guarded by lease_mu_
};

Result<std::vector<BlockSlot>> LocalBlockStore::Reserve(std::span<const BlockKey> keys) {
  std::shared_lock open(close_mu_);
  TPUSYNC_RETURN_IF_ERROR(Open());
  bool holding;
  {
    std::lock_guard lock(lease_mu_);
    holding = !reserved_.empty();
  }
  std::vector<BlockSlot> slots(keys.size());
  std::unordered_map<BlockKey, WriteLease, BlockKeyHash> got;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (got.count(keys[i])) continue;  // named twice: one slot
    {
      std::lock_guard lock(lease_mu_);
      if (reserved_.count(keys[i])) continue;  // reserved already by an earlier call
    }
    // Waits for a slot or another writer only while this object holds no reservation (no
    // hold-and-wait, as the sidecar does for a connection).
    Result<WriteLease> l = store_->Reserve(keys[i], !holding && got.empty());
    if (l.ok()) {
      slots[i] = {l->data(), l->capacity(), l->file_offset()};
      got.emplace(keys[i], std::move(l).value());
    } else if (l.status().code() != StatusCode::kFailedPrecondition) {  // not "already stored"
      return l.status();  // all or nothing: `got` gives its slots back
    }
  }
  std::lock_guard lock(lease_mu_);
  for (auto& [k, lease] : got) reserved_.emplace(k, std::move(lease));
  return slots;
}

Status LocalBlockStore::Commit(std::span<const BlockKey> keys, std::span<const uint64_t> lengths) {
  if (keys.size() != lengths.size()) return InvalidArgument("commit: keys and lengths differ in number");
  std::shared_lock open(close_mu_);
  TPUSYNC_RETURN_IF_ERROR(Open());
  for (size_t i = 0; i < keys.size(); ++i) {
    std::optional<WriteLease> lease;
    {
      std::lock_guard lock(lease_mu_);
      auto it = reserved_.find(keys[i]);
      if (it == reserved_.end()) return FailedPrecondition("commit: block " + keys[i].ToHex() + " was not reserved");
      lease.emplace(std::move(it->second));
      reserved_.erase(it);
    }
    TPUSYNC_RETURN_IF_ERROR(lease->Commit(lengths[i]));
  }
  return Status::Ok();
}

Status LocalBlockStore::Abort(std::span<const BlockKey> keys) {
  std::shared_lock open(close_mu_);
  TPUSYNC_RETURN_IF_ERROR(Open());
  std::lock_guard lock(lease_mu_);
  for (const BlockKey& k : keys) reserved_.erase(k);
  return Status::Ok();
}

Result<std::vector<BlockSlot>> LocalBlockStore::Acquire(std::span<const BlockKey> keys) {
  std::shared_lock open(close_mu_);
  TPUSYNC_RETURN_IF_ERROR(Open());
  std::vector<BlockSlot> slots(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    Result<ReadLease> l = store_->Acquire(keys[i]);
    if (!l.ok()) continue;  // absent (or unreadable: counted as a miss by the store)
    // The slot is read-only to callers (BlockSlot is shared with Reserve's writable ones).
    slots[i] = {const_cast<std::byte*>(l->data()), l->size(), l->file_offset()};
    std::lock_guard lock(lease_mu_);
    acquired_.emplace(keys[i], std::move(l).value());
  }
  return slots;
}

Status LocalBlockStore::Unacquire(std::span<const BlockKey> keys) {
  std::shared_lock open(close_mu_);
  TPUSYNC_RETURN_IF_ERROR(Open());
  std::lock_guard lock(lease_mu_);
  for (const BlockKey& k : keys) {
    if (auto it = acquired_.find(k); it != acquired_.end()) acquired_.erase(it);
  }
  return Status::Ok();
}

Result<PullReport> LocalBlockStore::PullFrom(const std::string& peer, std::span<const BlockKey> keys,
                                             bool digests) {
  std::shared_lock open(close_mu_);
  TPUSYNC_RETURN_IF_ERROR(Open());
  TPUSYNC_ASSIGN_OR_RETURN(std::shared_ptr<PeerClient> client, Peer(peer));
  PullResult pulled;
  Status st = PullIntoStore(*client, *store_, keys, Deadline::After(options_.transfer_timeout), pulled, digests);
  Failed(*client, st);
  TPUSYNC_RETURN_IF_ERROR(st);
  return PullReport{std::move(pulled.held), std::move(pulled.digests)};
}

Result<std::vector<uint8_t>> LocalBlockStore::PushTo(const std::string& peer, std::span<const BlockKey> keys) {
  std::shared_lock open(close_mu_);
  TPUSYNC_RETURN_IF_ERROR(Open());
  TPUSYNC_ASSIGN_OR_RETURN(std::shared_ptr<PeerClient> client, Peer(peer));
  std::vector<uint8_t> stored;
  Status st = PushFromStore(*client, *store_, keys, Deadline::After(options_.transfer_timeout), stored);
  Failed(*client, st);
  TPUSYNC_RETURN_IF_ERROR(st);
  return stored;
}

Result<std::vector<Tier>> LocalBlockStore::ExistsAt(const std::string& peer, std::span<const BlockKey> keys) {
  std::shared_lock open(close_mu_);
  TPUSYNC_RETURN_IF_ERROR(Open());
  TPUSYNC_ASSIGN_OR_RETURN(std::shared_ptr<PeerClient> client, Peer(peer));
  Result<std::vector<Tier>> tiers = client->Exists(keys, Deadline::After(options_.query_timeout));
  Failed(*client, tiers.status());
  return tiers;
}

}  // namespace

Result<std::unique_ptr<BlockStore>> OpenLocalBlockStore(const StoreOptions& store, PeerOptions peers) {
  TPUSYNC_ASSIGN_OR_RETURN(std::unique_ptr<Store> s, Store::Open(store));
  return std::unique_ptr<BlockStore>(std::make_unique<LocalBlockStore>(std::move(s), std::move(peers)));
}

}  // namespace tpusync::net
