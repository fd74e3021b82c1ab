// PeerClient: the client side of the data port, over several parallel streams to one peer.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "net/conn.h"
#include "net/members.h"
#include "tpusync/store.h"

namespace tpusync::net {

// Where pulled blocks land. Begin/Finish run on stream threads, never twice for one index.
class BlockSink {
 public:
  virtual ~BlockSink() = default;
  // The destination for block `index` (`length` bytes), or nullptr to drop it.
  virtual std::byte* Begin(size_t index, uint64_t length) = 0;
  // ok: every byte arrived and matched its tag. A sink must not publish a block otherwise.
  // `digest` is the payload's XXH3-64 when the sink wants digests, else 0. Returns whether the
  // block is now the sink's (landed and published).
  virtual bool Finish(size_t index, uint64_t length, bool ok, uint64_t digest) = 0;
  virtual bool wants_digests() const { return false; }
};

// Where pushed blocks come from. Open/Close run on stream threads, never twice for one index.
class BlockSource {
 public:
  virtual ~BlockSource() = default;
  // The bytes of block `index`, valid until Close(index); an error skips the block.
  virtual Result<std::span<const std::byte>> Open(size_t index) = 0;
  virtual void Close(size_t index) = 0;
};

struct PeerClientOptions {
  int streams = 2;
  std::chrono::milliseconds connect_timeout{5000};
  // The block size of this side's pool, which the peer's must equal (0: take the peer's).
  uint64_t block_bytes = 0;
  bool encrypt = false;  // ask for encrypted sessions
  std::chrono::milliseconds progress_timeout{10000};  // per frame (FramedConn::set_progress_timeout)
};

class PeerClient {
 public:
  // Connects and authenticates every stream now, so a wrong secret, a block size of another
  // pool or a dead peer shows here.
  static Result<std::unique_ptr<PeerClient>> Connect(const std::string& address, Secret secret,
                                                     PeerClientOptions options);
  ~PeerClient();

  const std::string& address() const { return address_; }
  uint64_t block_bytes() const { return block_bytes_.load(); }

  Result<std::vector<Tier>> Exists(std::span<const BlockKey> keys, Deadline d);
  // The keys are dealt round-robin over min(streams, keys) streams, starting after the ones
  // the previous request started on, so concurrent requests with few keys each use different
  // streams. received[i] = 1 for each block that landed whole. Returns the first error; blocks
  // of healthy streams still land. Thread-safe.
  Status Pull(std::span<const BlockKey> keys, BlockSink& sink, Deadline d, std::vector<uint8_t>& received);
  // stored[i] = 1 when the peer holds block i afterwards (sent now or held already).
  Status Push(std::span<const BlockKey> keys, BlockSource& source, Deadline d, std::vector<uint8_t>& stored);

 private:
  struct Stream;
  PeerClient() = default;
  Status Connected(Stream& s, Deadline d);
  // Connects `s` if need be, sends `op` with the key list and returns the peer's TIERS
  // reply, checked to hold one byte per key.
  Result<Frame> AskTiers(Stream& s, Op op, std::span<const BlockKey> keys, Deadline d);
  Status PullOn(Stream& s, std::span<const BlockKey> keys, std::span<const size_t> index, BlockSink& sink,
                Deadline d, std::vector<uint8_t>& received);
  Status PushOn(Stream& s, std::span<const BlockKey> keys, std::span<const size_t> index, BlockSource& source,
                Deadline d, std::vector<uint8_t>& stored);
  template <typename Fn>
  Status OnAllStreams(std::span<const BlockKey> keys, Fn fn);

  std::string address_, host_;
  uint16_t port_ = 0;
  std::optional<Secret> secret_;
  PeerClientOptions options_;
  std::atomic<uint64_t> block_bytes_{0};
  std::vector<std::unique_ptr<Stream>> streams_;
  std::atomic<size_t> next_stream_{0};  // where the next request's first key goes
};

// Connected clients by peer address, created on first use and replaced after a failure. Only
// `members` are dialled; a client's address() is the numeric address admitted.
class PeerPool {
 public:
  PeerPool(Secret secret, PeerClientOptions options, PoolMembers members)
      : secret_(std::move(secret)), options_(options), members_(std::move(members)) {}
  Result<std::shared_ptr<PeerClient>> Get(const std::string& address);
  // Drops the client of `address()` (after a failure), so the next Get reconnects.
  void Forget(const std::string& address);

 private:
  Secret secret_;
  PeerClientOptions options_;
  PoolMembers members_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<PeerClient>> clients_;  // guarded by mu_
};

// Prefix-aware pull into the local store: only the blocks the store lacks travel.
// held[i] = kLanded if block i arrived in this pull (with `digests`, digests[i] is then the
// XXH3-64 of the bytes that landed, computed as they arrived), kHeld if it was in the store already or was
// stored by another writer meanwhile, 0 if it is absent. bytes/blocks count what travelled.
enum HeldState : uint8_t { kAbsent = 0, kHeld = 1, kLanded = 2 };
struct PullResult {
  std::vector<uint8_t> held;
  std::vector<uint64_t> digests;
  uint64_t bytes = 0, blocks = 0;
};
Status PullIntoStore(PeerClient& peer, Store& store, std::span<const BlockKey> keys, Deadline d, PullResult& out,
                     bool digests = false);
// Pushes local blocks; the peer skips the ones it holds. stored[i] = 1 if the peer holds block i.
Status PushFromStore(PeerClient& peer, Store& store, std::span<const BlockKey> keys, Deadline d,
                     std::vector<uint8_t>& stored);

}  // namespace tpusync::net
