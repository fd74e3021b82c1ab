// The BlockStore contract, one set of cases run against each backend: the local store (a
// Store in this process) and the sidecar client (a real ControlService over a real Store,
// served on a UNIX socket in this process). Both talk to a real peer: a second Store behind
// a PeerService on a loopback data port. The data-port client, which maps no pool, is held to
// the part of the contract it serves and to clear refusals of the rest.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "net/control_service.h"
#include "net/metrics.h"
#include "net/peer_client.h"
#include "net/peer_service.h"
#include "net/server.h"
#include "test_util.h"
#include "tpusync/block_store.h"
#include "tpusync/net/block_stores.h"
#include "tpusync/store.h"

namespace tpusync::net {
namespace {

using namespace testing;  // NOLINT(google-build-using-namespace): the tests' own helpers
constexpr uint64_t kSlots = 16;
const std::string& TestSecret() {
  static const std::string secret = "0123456789abcdef-contract-secret";
  return secret;
}

std::unique_ptr<Store> OpenStore(const std::string& path) {
  StoreOptions o;
  o.pool = {.path = path, .block_bytes = kBlock, .num_slots = kSlots};
  return std::move(Store::Open(o)).value();
}

std::vector<MutableBuffer> Views(std::vector<std::vector<std::byte>>& out) {
  std::vector<MutableBuffer> bufs(out.size());
  for (size_t i = 0; i < out.size(); ++i) bufs[i] = {out[i].data(), out[i].size()};
  return bufs;
}

// A store served on a loopback data port, as a peer sidecar's.
class Peer {
 public:
  Peer() : store_(OpenStore(shm_.path())), service_(*store_, Secret(TestSecret()), metrics_, PeerServiceOptions{}) {
    server_ = std::make_unique<ConnectionServer>(
        "data", std::move(Listener::ListenTcp("127.0.0.1", 0)).value(),
        [this](Connection& conn) { service_.Serve(conn); }, ServerLimits{.max_admitted = 16, .max_pending = 16});
    server_->Start();
  }
  ~Peer() { server_->Stop(std::chrono::milliseconds(0)); }
  std::string address() const { return "127.0.0.1:" + std::to_string(server_->port()); }
  Store& store() { return *store_; }

 private:
  ShmPath shm_;
  std::unique_ptr<Store> store_;
  Metrics metrics_;
  PeerService service_;
  std::unique_ptr<ConnectionServer> server_;
};

// Each backend: how to make it, and the Store behind it (to check effects from outside).
struct LocalBackend {
  static constexpr bool kPinsBelongToTheSession = false;
  LocalBackend() {
    StoreOptions o;
    o.pool = {.path = shm_.path(), .block_bytes = kBlock, .num_slots = kSlots};
    store = std::move(OpenLocalBlockStore(o, PeerOptions{.secret = TestSecret(), .streams = 1})).value();
  }
  ShmPath shm_;
  std::unique_ptr<BlockStore> store;
};

struct SidecarBackend {
  static constexpr bool kPinsBelongToTheSession = true;
  SidecarBackend() : backing(OpenStore(shm_.path())), peers(Secret(TestSecret()), PeerClientOptions{.streams = 1}, PoolMembers::Anyone()) {
    path = dir.file("control.sock");
    control = std::make_unique<ControlService>(*backing, peers, metrics, std::chrono::seconds(10));
    server = std::make_unique<ConnectionServer>(
        "control", std::move(Listener::ListenUnix(path)).value(), [this](Connection& conn) { control->Serve(conn); },
        ServerLimits{.max_admitted = 16, .max_pending = 16});
    server->Start();
    store = std::move(ConnectSidecar(path, std::chrono::seconds(10))).value();
  }
  ~SidecarBackend() {
    store.reset();
    server->Stop(std::chrono::milliseconds(0));
  }
  ShmPath shm_;
  TempDir dir;
  std::string path;
  std::unique_ptr<Store> backing;
  PeerPool peers;
  Metrics metrics;
  std::unique_ptr<ControlService> control;
  std::unique_ptr<ConnectionServer> server;
  std::unique_ptr<BlockStore> store;
};

template <typename Backend>
class BlockStoreContract : public ::testing::Test {
 protected:
  BlockStore& store() { return *backend_.store; }
  Status PutKeys(BlockStore& s, const std::vector<BlockKey>& keys) {
    std::vector<std::vector<std::byte>> data(keys.size());
    std::vector<ConstBuffer> bufs(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      data[i] = Pattern(keys[i], kBlock);
      bufs[i] = {data[i].data(), data[i].size()};
    }
    return s.Put(keys, bufs);
  }
  uint64_t Stat(uint64_t StoreStats::*field) {
    Result<StoreStats> s = store().Stats();
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? (*s).*field : ~uint64_t{0};
  }
  static std::vector<BlockKey> Keys(uint64_t first, uint64_t n) {
    std::vector<BlockKey> keys;
    for (uint64_t i = first; i < first + n; ++i) keys.push_back(Key(i));
    return keys;
  }

  Backend backend_;
};

using Backends = ::testing::Types<LocalBackend, SidecarBackend>;
TYPED_TEST_SUITE(BlockStoreContract, Backends);

TYPED_TEST(BlockStoreContract, PutThenGetAndLookupSeeTheSameBytes) {
  auto keys = this->Keys(1, 3);
  ASSERT_TRUE(this->PutKeys(this->store(), keys).ok());
  ASSERT_TRUE(this->PutKeys(this->store(), keys).ok());  // present keys are skipped
  std::vector<BlockKey> ask = keys;
  ask.push_back(Key(99));
  Result<LookupResult> r = this->store().Lookup(ask, false);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->prefix_len, 3u);
  EXPECT_EQ(r->tiers, (std::vector<Tier>{Tier::kDram, Tier::kDram, Tier::kDram, Tier::kNone}));
  std::vector<std::vector<std::byte>> out(4, std::vector<std::byte>(kBlock));
  std::vector<MutableBuffer> bufs = Views(out);
  std::vector<uint8_t> found(4);
  ASSERT_TRUE(this->store().Get(ask, bufs, found).ok());
  EXPECT_EQ(found, (std::vector<uint8_t>{1, 1, 1, 0}));
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(out[i], Pattern(keys[i], kBlock));
  EXPECT_EQ(this->Stat(&StoreStats::blocks), 3u);
  EXPECT_EQ(this->store().block_bytes(), kBlock);
  EXPECT_FALSE(this->store().pool_path().empty());
}

TYPED_TEST(BlockStoreContract, MalformedPutsAreRefusedAndStoreNothing) {
  BlockKey k = Key(1);
  std::vector<std::byte> big(kBlock + 1);
  ConstBuffer too_big{big.data(), big.size()};
  ConstBuffer empty{big.data(), 0};
  EXPECT_EQ(this->store().Put({&k, 1}, {&too_big, 1}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(this->store().Put({&k, 1}, {&empty, 1}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(this->Stat(&StoreStats::blocks), 0u);
}

TYPED_TEST(BlockStoreContract, PinsAreCheckedAndCounted) {
  auto keys = this->Keys(1, 2);
  ASSERT_TRUE(this->PutKeys(this->store(), keys).ok());
  BlockKey absent = Key(50);
  EXPECT_EQ(this->store().Pin({&absent, 1}, false).code(), StatusCode::kNotFound);
  EXPECT_EQ(this->store().Release({&keys[0], 1}, false).code(), StatusCode::kFailedPrecondition);
  Result<LookupResult> r = this->store().Lookup(keys, true);  // pins the present prefix
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(this->Stat(&StoreStats::pinned), 2u);
  ASSERT_TRUE(this->store().Release(keys, false).ok());
  ASSERT_TRUE(this->store().Pin({&keys[0], 1}, false).ok());
  EXPECT_EQ(this->Stat(&StoreStats::pinned), 1u);
  ASSERT_TRUE(this->store().Release({&keys[0], 1}, false).ok());
  EXPECT_EQ(this->Stat(&StoreStats::pinned), 0u);
}

TYPED_TEST(BlockStoreContract, ReservedSlotsAreWrittenInPlaceAndPublishedByCommit) {
  ASSERT_TRUE(this->PutKeys(this->store(), {Key(1)}).ok());
  std::vector<BlockKey> keys = {Key(1), Key(2), Key(3)};
  Result<std::vector<BlockSlot>> slots = this->store().Reserve(keys);
  ASSERT_TRUE(slots.ok()) << slots.status().ToString();
  EXPECT_EQ((*slots)[0].data, nullptr);  // stored already
  ASSERT_NE((*slots)[1].data, nullptr);
  ASSERT_NE((*slots)[2].data, nullptr);
  EXPECT_GE((*slots)[1].size, kBlock);
  auto data = Pattern(Key(2), kBlock);
  std::copy(data.begin(), data.end(), (*slots)[1].data);
  EXPECT_EQ(this->store().Lookup({&keys[1], 1}, false)->prefix_len, 0u);  // not before the commit
  uint64_t length = kBlock;
  ASSERT_TRUE(this->store().Commit({&keys[1], 1}, {&length, 1}).ok());
  ASSERT_TRUE(this->store().Abort({&keys[2], 1}).ok());
  EXPECT_EQ(this->store().Commit({&keys[2], 1}, {&length, 1}).code(), StatusCode::kFailedPrecondition);
  Result<LookupResult> r = this->store().Lookup(keys, false);
  EXPECT_EQ(r->tiers, (std::vector<Tier>{Tier::kDram, Tier::kDram, Tier::kNone}));
  EXPECT_EQ(this->Stat(&StoreStats::dram_used), 2u);  // the aborted slot is free again
}

TYPED_TEST(BlockStoreContract, ReserveIsAllOrNothing) {
  auto keys = this->Keys(1, kSlots + 1);  // one more than the pool holds
  Result<std::vector<BlockSlot>> slots = this->store().Reserve(keys);
  ASSERT_FALSE(slots.ok());
  EXPECT_EQ(slots.status().code(), StatusCode::kResourceExhausted) << slots.status().ToString();
  EXPECT_EQ(this->Stat(&StoreStats::dram_used), 0u);  // nothing left reserved
  ASSERT_TRUE(this->PutKeys(this->store(), this->Keys(1, kSlots)).ok());
}

TYPED_TEST(BlockStoreContract, AcquiredBlocksAreReadInPlaceAndStayUntilUnacquired) {
  ASSERT_TRUE(this->PutKeys(this->store(), {Key(1)}).ok());
  std::vector<BlockKey> keys = {Key(1), Key(2)};
  Result<std::vector<BlockSlot>> slots = this->store().Acquire(keys);
  ASSERT_TRUE(slots.ok());
  ASSERT_NE((*slots)[0].data, nullptr);
  EXPECT_EQ((*slots)[1].data, nullptr);  // absent
  ASSERT_EQ((*slots)[0].size, kBlock);
  EXPECT_EQ(std::vector<std::byte>((*slots)[0].data, (*slots)[0].data + kBlock), Pattern(Key(1), kBlock));
  ASSERT_TRUE(this->store().Unacquire({&keys[0], 1}).ok());
  ASSERT_TRUE(this->store().Evict({&keys[0], 1}).ok());  // nothing holds it now: it can go
  EXPECT_EQ(this->store().Lookup({&keys[0], 1}, false)->prefix_len, 0u);
  EXPECT_TRUE(this->store().Flush().ok());
}

TYPED_TEST(BlockStoreContract, PullFetchesOnlyWhatIsMissingAndReportsWhatLanded) {
  Peer peer;
  auto keys = this->Keys(1, 4);
  for (const BlockKey& k : keys) {
    auto d = Pattern(k, kBlock);
    ConstBuffer b{d.data(), d.size()};
    ASSERT_TRUE(peer.store().Put({&k, 1}, {&b, 1}).ok());
  }
  ASSERT_TRUE(this->PutKeys(this->store(), {keys[0]}).ok());
  Result<PullReport> r = this->store().PullFrom(peer.address(), keys, /*digests=*/true);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->held, (std::vector<uint8_t>{kBlockHeld, kBlockLanded, kBlockLanded, kBlockLanded}));
  ASSERT_EQ(r->digests.size(), 4u);
  EXPECT_EQ(r->digests[0], 0u);
  EXPECT_NE(r->digests[1], 0u);
  EXPECT_EQ(this->store().Lookup(keys, false)->prefix_len, 4u);
}

TYPED_TEST(BlockStoreContract, PushAndExistsAtAPeer) {
  Peer peer;
  auto keys = this->Keys(20, 2);
  ASSERT_TRUE(this->PutKeys(this->store(), keys).ok());
  Result<std::vector<uint8_t>> stored = this->store().PushTo(peer.address(), keys);
  ASSERT_TRUE(stored.ok()) << stored.status().ToString();
  EXPECT_EQ(*stored, (std::vector<uint8_t>{1, 1}));
  std::vector<BlockKey> ask = keys;
  ask.push_back(Key(30));
  Result<std::vector<Tier>> tiers = this->store().ExistsAt(peer.address(), ask);
  ASSERT_TRUE(tiers.ok()) << tiers.status().ToString();
  EXPECT_EQ(*tiers, (std::vector<Tier>{Tier::kDram, Tier::kDram, Tier::kNone}));
  EXPECT_EQ(peer.store().Lookup(keys, false).prefix_len, 2u);
}

TYPED_TEST(BlockStoreContract, APeerNobodyListensOnIsUnavailable) {
  BlockKey k = Key(1);
  Result<PullReport> r = this->store().PullFrom("127.0.0.1:1", {&k, 1}, false);  // a port nothing listens on
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
}

TYPED_TEST(BlockStoreContract, CloseEndsTheSessionAndLaterCallsFail) {
  auto keys = this->Keys(1, 2);
  ASSERT_TRUE(this->PutKeys(this->store(), keys).ok());
  ASSERT_TRUE(this->store().Pin({&keys[0], 1}, false).ok());
  ASSERT_TRUE(this->store().Acquire({&keys[1], 1}).ok());
  ASSERT_TRUE(this->store().Reserve(this->Keys(5, 1)).ok());
  this->store().Close();
  this->store().Close();  // idempotent
  EXPECT_FALSE(this->PutKeys(this->store(), this->Keys(7, 1)).ok());
  EXPECT_FALSE(this->store().Lookup(keys, false).ok());
  if constexpr (TypeParam::kPinsBelongToTheSession) {
    // The sidecar dropped this session's pin, lease and reservation before Close returned.
    StoreStats s = this->backend_.backing->Stats();
    EXPECT_EQ(s.pinned, 0u);
    EXPECT_EQ(s.dram_used, 2u);
  }
}

// ---- the data-port client ----------------------------------------------------------------

class DataPortContract : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = std::move(ConnectDataPort(peer_.address(), PeerOptions{.secret = TestSecret(), .streams = 2})).value();
  }
  Peer peer_;
  std::unique_ptr<BlockStore> store_;
};

TEST_F(DataPortContract, PutPushesGetPullsLookupAsks) {
  std::vector<BlockKey> keys = {Key(1), Key(2)};
  auto a = Pattern(keys[0], kBlock), b = Pattern(keys[1], 100);
  std::vector<ConstBuffer> in = {{a.data(), a.size()}, {b.data(), b.size()}};
  ASSERT_TRUE(store_->Put(keys, in).ok());
  EXPECT_EQ(peer_.store().Lookup(keys, false).prefix_len, 2u);
  std::vector<BlockKey> ask = {Key(1), Key(2), Key(3)};
  Result<LookupResult> r = store_->Lookup(ask, false);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->prefix_len, 2u);
  std::vector<std::vector<std::byte>> out = {std::vector<std::byte>(kBlock), std::vector<std::byte>(100),
                                             std::vector<std::byte>(kBlock)};
  std::vector<MutableBuffer> bufs = Views(out);
  std::vector<uint8_t> found(3);
  ASSERT_TRUE(store_->Get(ask, bufs, found).ok());
  EXPECT_EQ(found, (std::vector<uint8_t>{1, 1, 0}));
  EXPECT_EQ(out[0], a);
  EXPECT_EQ(out[1], b);
  // The short block into a whole block's buffer: a miss, never a buffer left half stale.
  std::vector<std::vector<std::byte>> whole(1, std::vector<std::byte>(kBlock));
  std::vector<MutableBuffer> whole_bufs = Views(whole);
  ASSERT_TRUE(store_->Get({&keys[1], 1}, whole_bufs, {found.data(), 1}).ok());
  EXPECT_EQ(found[0], 0);
  EXPECT_EQ(store_->Stats()->block_bytes, kBlock);
  EXPECT_TRUE(store_->pool_path().empty());
}

TEST_F(DataPortContract, WhatNeedsAPoolHereIsRefusedWithTheReason) {
  BlockKey k = Key(1);
  uint64_t length = 1;
  std::vector<Status> refused = {
      store_->Lookup({&k, 1}, true).status(), store_->Pin({&k, 1}, false), store_->Release({&k, 1}, true),
      store_->Evict({&k, 1}), store_->Reserve({&k, 1}).status(), store_->Commit({&k, 1}, {&length, 1}),
      store_->Abort({&k, 1}), store_->Acquire({&k, 1}).status(), store_->Unacquire({&k, 1}),
      store_->PullFrom(peer_.address(), {&k, 1}, false).status(), store_->PushTo(peer_.address(), {&k, 1}).status(),
      store_->ExistsAt(peer_.address(), {&k, 1}).status(),
  };
  for (const Status& st : refused) {
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
    EXPECT_NE(st.message().find("data-port client (tpusync://) has no pool"), std::string::npos) << st.message();
  }
  EXPECT_EQ(peer_.store().Stats().pinned, 0u);
}

TEST_F(DataPortContract, AWrongSecretIsRefusedAtConnect) {
  auto r = ConnectDataPort(peer_.address(), PeerOptions{.secret = "not-the-secret-at-all"});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnauthenticated) << r.status().ToString();
  EXPECT_EQ(ConnectDataPort(peer_.address(), PeerOptions{}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tpusync::net
