// The network layer against real sockets: socketpairs for one service, loopback listeners
// for the connection budgets, a UNIX control socket for the engine-facing client.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <array>
#include <cstring>
#include <filesystem>
#include <optional>
#include <thread>

#include "net/control_client.h"
#include "net/control_service.h"
#include "net/peer_service.h"
#include "net/server.h"
#include "net/metrics.h"
#include "test_util.h"
#include "tpusync/store.h"

namespace tpusync::net {
namespace {

using namespace testing;  // NOLINT(google-build-using-namespace): the tests' own helpers
// A function-local static: a namespace-scope Secret could throw before main, uncaught.
const Secret& TestSecret() {
  static const Secret secret("0123456789abcdef-test-secret");
  return secret;
}

Deadline Soon() { return Deadline::After(std::chrono::seconds(5)); }

std::pair<Socket, Socket> SocketPair() {
  int fds[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, fds), 0);
  return {Socket(UniqueFd(fds[0])), Socket(UniqueFd(fds[1]))};
}

class NetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    StoreOptions o;
    o.pool = {.path = shm_.path(), .block_bytes = kBlock, .num_slots = 16};
    store_ = std::move(Store::Open(o)).value();
  }
  void PutBlock(uint64_t i) {
    auto data = Pattern(Key(i), kBlock);
    BlockKey k = Key(i);
    ConstBuffer b{data.data(), data.size()};
    ASSERT_TRUE(store_->Put({&k, 1}, {&b, 1}).ok());
  }
  // Serves one data connection on its own thread; the client end is returned authenticated.
  FramedConn& ServeData() {
    auto [client, server] = SocketPair();
    server_socket_ = std::move(server);
    client_socket_ = std::move(client);
    service_.emplace(*store_, TestSecret(), metrics_, PeerServiceOptions{});
    thread_ = std::thread([this] {
      Connection conn(server_socket_, stop_, "test", [] { return Status::Ok(); });
      service_->Serve(conn);
      server_socket_.Close();
    });
    client_.emplace(client_socket_, kBlock);
    EXPECT_TRUE(ClientHandshake(*client_, TestSecret(), {}, Soon()).ok());
    return *client_;
  }
  void TearDown() override {
    if (thread_.joinable()) {
      client_socket_.Shutdown();
      thread_.join();
    }
  }

  ShmPath shm_;
  std::unique_ptr<Store> store_;
  Metrics metrics_;
  WakeFd stop_;
  Socket server_socket_, client_socket_;
  std::optional<PeerService> service_;
  std::optional<FramedConn> client_;
  std::thread thread_;
};

TEST_F(NetTest, ABodyThatDisagreesWithItsKeyCountIsRefusedBeforeItIsRead) {
  FramedConn& c = ServeData();
  FrameHeader h;
  h.op = Op::kPull;
  h.count = 1;
  h.body_len = 64ull << 20;  // declared, never sent
  std::byte hdr[kHeaderBytes];
  EncodeHeader(h, hdr);
  ASSERT_TRUE(c.socket().WriteFull(hdr, kHeaderBytes, Soon()).ok());
  // The reply comes without the body: nothing waited for (or allocated) 64 MiB.
  Result<Frame> reply = c.Recv(Soon());
  ASSERT_FALSE(reply.ok());
  EXPECT_EQ(reply.status().code(), StatusCode::kMalformed);
  EXPECT_NE(reply.status().message().find("16 bytes per key"), std::string::npos) << reply.status().message();
  EXPECT_EQ(metrics_.bad_frames.load(), 1u);
}

TEST_F(NetTest, APullNamingOneBlockManyTimesSendsItOnce) {
  PutBlock(1);
  FramedConn& c = ServeData();
  std::vector<BlockKey> keys(100, Key(1));
  BodyWriter w;
  WriteKeyList(w, keys);
  ASSERT_TRUE(c.Send(Op::kPull, w.bytes(), Soon(), static_cast<uint32_t>(keys.size())).ok());
  Result<Frame> tiers = c.Expect(Op::kTiers, Soon());
  ASSERT_TRUE(tiers.ok()) << tiers.status().ToString();
  ASSERT_EQ(tiers->body.size(), keys.size());
  EXPECT_EQ(std::to_integer<uint8_t>(tiers->body[0]), static_cast<uint8_t>(Tier::kDram));
  for (size_t i = 1; i < keys.size(); ++i) EXPECT_EQ(std::to_integer<uint8_t>(tiers->body[i]), 0) << i;
  int blocks = 0;
  for (;;) {
    Result<FrameHeader> h = c.RecvBlockHeader(Soon());
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    if (h->op == Op::kEnd) break;
    std::vector<std::byte> dst(h->body_len);
    ASSERT_TRUE(c.RecvBlockPayload(dst.data(), h->body_len, Soon()).ok());
    EXPECT_EQ(dst, Pattern(Key(1), kBlock));
    ++blocks;
  }
  EXPECT_EQ(blocks, 1);
}

// ---- connection budgets, over loopback with distinct source addresses ----------------------

Socket ConnectFrom(const std::string& source, uint16_t port) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in local{};
  local.sin_family = AF_INET;
  ::inet_pton(AF_INET, source.c_str(), &local.sin_addr);
  EXPECT_EQ(::bind(fd.get(), reinterpret_cast<sockaddr*>(&local), sizeof local), 0);
  sockaddr_in remote{};
  remote.sin_family = AF_INET;
  remote.sin_port = htons(port);
  ::inet_pton(AF_INET, "127.0.0.1", &remote.sin_addr);
  EXPECT_EQ(::connect(fd.get(), reinterpret_cast<sockaddr*>(&remote), sizeof remote), 0);
  int flags = ::fcntl(fd.get(), F_GETFL);
  ::fcntl(fd.get(), F_SETFL, flags | O_NONBLOCK);
  return Socket(std::move(fd));
}

// A server whose handler authenticates (a one-byte "proof"), then holds the connection
// until the client goes: stands for the data port without the store.
class BudgetTest : public ::testing::Test {
 protected:
  void Start(ServerLimits limits) {
    auto l = Listener::ListenTcp("127.0.0.1", 0);
    ASSERT_TRUE(l.ok());
    server_ = std::make_unique<ConnectionServer>(
        "test", std::move(l).value(),
        [](Connection& conn) {
          std::byte b;
          if (!conn.socket().ReadFull(&b, 1, Soon()).ok()) return;  // the "handshake"
          std::byte reply{conn.Admit().ok() ? uint8_t{'A'} : uint8_t{'R'}};
          if (!conn.socket().WriteFull(&reply, 1, Soon()).ok()) return;
          while (conn.socket().ReadFull(&b, 1, Soon()).ok()) {
          }
        },
        limits);
    server_->Start();
  }
  // Authenticates a fresh connection: 'A' admitted, 'R' refused after the handshake, 'E'
  // refused before it (an ERROR frame or a cut).
  char Authenticate(Socket& s) {
    std::byte b{uint8_t{'x'}};
    if (!s.WriteFull(&b, 1, Soon()).ok()) return 'E';
    if (!s.ReadFull(&b, 1, Soon()).ok()) return 'E';
    char c = static_cast<char>(std::to_integer<uint8_t>(b));
    return c == 'A' || c == 'R' ? c : 'E';
  }
  // A fresh connection to the server from `source`.
  Socket Connect(const std::string& source) { return ConnectFrom(source, server_->port()); }
  // `n` connections from `source` that never authenticate.
  std::vector<Socket> ConnectIdle(const std::string& source, int n) {
    std::vector<Socket> idle;
    idle.reserve(n);
    for (int i = 0; i < n; ++i) idle.push_back(Connect(source));
    return idle;
  }
  std::unique_ptr<ConnectionServer> server_;
};

TEST_F(BudgetTest, IdleConnectionsFromOneSourceCannotLockOutOthers) {
  Start({.max_admitted = 4, .max_pending = 16, .max_pending_per_source = 3, .pending_grace = std::chrono::hours(1)});
  std::vector<Socket> idle = ConnectIdle("127.0.0.2", 3);
  Socket over = Connect("127.0.0.2");
  EXPECT_EQ(Authenticate(over), 'E');  // the fourth from that address is refused
  Socket legit = Connect("127.0.0.1");
  EXPECT_EQ(Authenticate(legit), 'A');
  EXPECT_GE(server_->refused(), 1u);
}

TEST_F(BudgetTest, WhenThePendingBudgetIsFullTheOldestPendingIsCut) {
  Start({.max_admitted = 4, .max_pending = 4, .max_pending_per_source = 2, .pending_grace = std::chrono::milliseconds(0)});
  std::vector<Socket> idle;
  for (const char* src : {"127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"}) {
    idle.push_back(Connect(src));
  }
  Socket legit = Connect("127.0.0.1");
  EXPECT_EQ(Authenticate(legit), 'A');
  EXPECT_EQ(server_->cut_pending(), 1u);
  EXPECT_EQ(Authenticate(idle[0]), 'E');  // the oldest idle one was cut
}

TEST_F(BudgetTest, UnauthenticatedConnectionsNeverTakeAdmittedSlots) {
  Start({.max_admitted = 2, .max_pending = 8, .max_pending_per_source = 8, .pending_grace = std::chrono::hours(1)});
  std::vector<Socket> idle = ConnectIdle("127.0.0.2", 6);
  Socket a = Connect("127.0.0.1");
  EXPECT_EQ(Authenticate(a), 'A');
  Socket b = Connect("127.0.0.1");
  EXPECT_EQ(Authenticate(b), 'A');
  Socket c = Connect("127.0.0.1");
  EXPECT_EQ(Authenticate(c), 'R');  // the admitted budget, not the idle ones, is what is full
}

// One source holding admitted connections open cannot lock every other host out.
TEST_F(BudgetTest, AdmittedConnectionsAreLimitedPerSource) {
  Start({.max_admitted = 8, .max_admitted_per_source = 3, .max_pending = 16, .max_pending_per_source = 16});
  std::vector<Socket> held;
  held.reserve(3);
  for (int i = 0; i < 3; ++i) {
    held.push_back(Connect("127.0.0.2"));
    EXPECT_EQ(Authenticate(held.back()), 'A');
  }
  Socket fourth = Connect("127.0.0.2");
  EXPECT_EQ(Authenticate(fourth), 'R');
  Socket other = Connect("127.0.0.3");
  EXPECT_EQ(Authenticate(other), 'A');
}

TEST_F(BudgetTest, AStoppedServerRefusesNewConnectionsInsteadOfQueueingThem) {
  Start({});
  uint16_t port = server_->port();
  server_->Stop(std::chrono::milliseconds(0));
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in remote{};
  remote.sin_family = AF_INET;
  remote.sin_port = htons(port);
  ::inet_pton(AF_INET, "127.0.0.1", &remote.sin_addr);
  EXPECT_NE(::connect(fd.get(), reinterpret_cast<sockaddr*>(&remote), sizeof remote), 0);
  EXPECT_EQ(errno, ECONNREFUSED);
}

TEST(ListenerTest, AControlSocketPathHoldingAFileIsNotReplaced) {
  TempDir dir;
  std::string path = dir.file("control.sock");
  FILE* f = std::fopen(path.c_str(), "w");
  std::fputs("precious", f);
  std::fclose(f);
  Result<Listener> l = Listener::ListenUnix(path);
  EXPECT_EQ(l.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(std::filesystem::exists(path));
  // A stale socket is replaced.
  std::filesystem::remove(path);
  { ASSERT_TRUE(Listener::ListenUnix(path).ok()); }
  EXPECT_TRUE(Listener::ListenUnix(path).ok());
}

// ---- the control channel, through the engine's client ----------------------------------

class ControlTest : public NetTest {
 protected:
  void SetUp() override {
    NetTest::SetUp();
    path_ = dir_.file("control.sock");
    peers_ = std::make_unique<PeerPool>(TestSecret(), PeerClientOptions{.streams = 1},
                                       PoolMembers::Configured({"127.0.0.1"}, "", 0).value());
    control_ = std::make_unique<ControlService>(*store_, *peers_, metrics_, std::chrono::seconds(10));
    server_ = std::make_unique<ConnectionServer>(
        "control", std::move(Listener::ListenUnix(path_)).value(),
        [this](Connection& conn) { control_->Serve(conn); }, ServerLimits{.max_admitted = 64, .max_pending = 64});
    server_->Start();
  }
  void TearDown() override {
    server_->Stop(std::chrono::milliseconds(0));
    NetTest::TearDown();
  }
  std::unique_ptr<SidecarClient> Client() {
    return std::move(SidecarClient::Connect(path_, std::chrono::seconds(10))).value();
  }
  TempDir dir_;
  std::string path_;
  std::unique_ptr<PeerPool> peers_;
  std::unique_ptr<ControlService> control_;
  std::unique_ptr<ConnectionServer> server_;
};

TEST_F(ControlTest, APutWaitsForAnotherConnectionsReservationAndStoresWhenItIsAborted) {
  auto holder = Client();
  auto writer = Client();
  BlockKey k = Key(4);
  auto views = holder->Reserve({&k, 1});
  ASSERT_TRUE(views.ok());
  ASSERT_NE((*views)[0].data, nullptr);
  auto data = Pattern(k, kBlock);
  Status put = Status::Ok();
  std::thread t([&] {
    ConstBuffer b{data.data(), data.size()};
    put = writer->Put({&k, 1}, {&b, 1});
  });
  ASSERT_TRUE(testing::Eventually([&] { return holder->Stats()->waiting_writers == 1; }));
  ASSERT_TRUE(holder->Abort({&k, 1}).ok());
  t.join();
  ASSERT_TRUE(put.ok()) << put.ToString();
  std::vector<std::byte> out(kBlock);
  MutableBuffer mb{out.data(), out.size()};
  uint8_t found = 0;
  ASSERT_TRUE(writer->Get({&k, 1}, {&mb, 1}, {&found, 1}).ok());
  EXPECT_TRUE(found);
  EXPECT_EQ(out, data);
}

TEST_F(ControlTest, ReleasingForTheHostUndoesOnlyHostPins) {
  PutBlock(5);
  BlockKey k = Key(5);
  auto engine = Client();
  auto other = Client();
  ASSERT_TRUE(engine->Pin({&k, 1}, false).ok());  // the engine connection's pin
  EXPECT_EQ(other->Release({&k, 1}, true).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(store_->Stats().pinned, 1u);
  ASSERT_TRUE(other->Pin({&k, 1}, true).ok());
  ASSERT_TRUE(engine->Release({&k, 1}, true).ok());  // any connection may release a host pin
  EXPECT_EQ(engine->Release({&k, 1}, true).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(engine->Release({&k, 1}, false).ok());
  EXPECT_EQ(store_->Stats().pinned, 0u);
}

TEST_F(ControlTest, TheClientReadsEveryCounterAndFlagOfTheStoresStats) {
  for (uint64_t i = 20; i < 24; ++i) PutBlock(i);
  auto client = Client();
  std::vector<std::byte> out(kBlock);
  for (uint64_t i = 22; i < 26; ++i) {  // two hits, two misses
    BlockKey k = Key(i);
    MutableBuffer mb{out.data(), out.size()};
    uint8_t found = 0;
    ASSERT_TRUE(client->Get({&k, 1}, {&mb, 1}, {&found, 1}).ok());
  }
  const StoreStats want = store_->Stats();
  Result<StoreStats> got = client->Stats();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_GT(want.puts, 0u);
  EXPECT_GT(want.hits_dram, 0u);
  EXPECT_GT(want.misses, 0u);
  for (const auto& [name, field] : kStoreCounters) EXPECT_EQ(got.value().*field, want.*field) << name;
  for (const auto& [name, field] : kStoreFlags) EXPECT_EQ(got.value().*field, want.*field) << name;
  for (const auto& [name, field] : kSharedTierCounters) EXPECT_EQ(got.value().shared.*field, want.shared.*field) << name;
  EXPECT_EQ(got.value().shared.direct_io, want.shared.direct_io);
  EXPECT_EQ(got.value().last_error, want.last_error);
}

// A data port that announces every block, sends the first `serve` of them, then hangs up.
class DyingSource {
 public:
  explicit DyingSource(size_t serve) {
    listener_.emplace(std::move(Listener::ListenTcp("127.0.0.1", 0)).value());
    thread_ = std::thread([this, serve] {
      Result<Socket> s = listener_->Accept(stop_.fd());
      if (!s.ok() || !s->valid()) return;
      FramedConn c(*s, kBlock);
      if (!ServerHandshake(c, TestSecret(), {.block_bytes = kBlock}, Soon()).ok()) return;
      Result<Frame> f = c.RecvKeyRequest(std::array{Op::kPull}, Soon());
      if (!f.ok()) return;
      auto keys = std::move(ParseKeyList(f->body, f->header.count)).value();
      std::vector<Tier> tiers(keys.size(), Tier::kDram);
      (void)c.Send(Op::kTiers, std::as_bytes(std::span(tiers)), Soon(), static_cast<uint32_t>(keys.size()));
      for (size_t i = 0; i < serve && i < keys.size(); ++i) {
        auto data = Pattern(keys[i], kBlock);
        (void)c.SendBlock(static_cast<uint32_t>(i), data.data(), data.size(), Soon());
      }
    });  // the socket closes here: the source "died"
  }
  ~DyingSource() {
    stop_.Fire();
    thread_.join();
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(listener_->port()); }

 private:
  std::optional<Listener> listener_;
  WakeFd stop_;
  std::thread thread_;
};

TEST_F(ControlTest, APullFromASourceThatDiesPartWayFailsAndKeepsWhatArrived) {
  DyingSource source(3);
  auto engine = Client();
  std::vector<BlockKey> keys;
  for (uint64_t i = 10; i < 18; ++i) keys.push_back(Key(i));
  Result<PullReport> held = engine->PullFrom(source.address(), keys, false);
  ASSERT_FALSE(held.ok());
  EXPECT_EQ(held.status().code(), StatusCode::kUnavailable) << held.status().ToString();
  EXPECT_NE(held.status().message().find("of 8 blocks held"), std::string::npos) << held.status().message();
  EXPECT_GE(store_->Lookup(keys, false).prefix_len, 1u);  // what arrived whole stays
}

// The control channel's PULL_FROM names any address it likes; the sidecar dials only the
// pool's members, so it cannot be used to scan ports or reach another pool.
TEST_F(ControlTest, APeerOutsideThePoolIsNeverDialled) {
  Result<Listener> outsider = Listener::ListenTcp("127.0.0.2", 0);
  ASSERT_TRUE(outsider.ok()) << outsider.status().ToString();
  auto engine = Client();
  std::vector<BlockKey> keys = {Key(1)};
  const std::string address = "127.0.0.2:" + std::to_string(outsider->port());
  for (int op = 0; op < 3; ++op) {
    Status st = op == 0   ? engine->PullFrom(address, keys, false).status()
                : op == 1 ? engine->PushTo(address, keys).status()
                          : engine->ExistsAt(address, keys).status();
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
    EXPECT_NE(st.message().find("is not a member of this pool"), std::string::npos) << st.message();
  }
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  EXPECT_LT(::accept4(outsider->fd(), reinterpret_cast<sockaddr*>(&addr), &len, SOCK_NONBLOCK), 0);
  EXPECT_EQ(errno, EAGAIN);
}

}  // namespace
}  // namespace tpusync::net
