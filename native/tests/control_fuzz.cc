// libFuzzer target: arbitrary bytes on the control channel, served by a real ControlService
// over a real Store, as an engine in the pod could send them. Must never crash or leak, and
// every lease and pin the input took is gone once its connection closed.
//
// Requests that would reach out to a peer (PULL_FROM, PUSH_TO, EXISTS_AT) are turned into
// INFO before they are sent: a fuzzer must not connect to addresses it made up. Host pins
// (which outlive connections by design) become connection pins, so that no pin may remain.
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "net/control_service.h"
#include "net/server.h"
#include "net/metrics.h"
#include "tpusync/store.h"

using namespace tpusync;
using namespace tpusync::net;

namespace {

struct World {
  World() {
    StoreOptions o;
    o.pool = {.path = "/dev/shm/tpusync-control-fuzz-" + std::to_string(::getpid()), .block_bytes = 4096,
              .num_slots = 64};
    o.write_wait = std::chrono::milliseconds(1);
    store = std::move(Store::Open(o)).value();
    ::unlink(o.pool.path.c_str());  // the mapping stays; nothing is left behind
    peers = std::make_unique<PeerPool>(Secret("fuzz-secret-0123456789"), PeerClientOptions{},
                                       PoolMembers::Configured({}, "", 0).value());
    service = std::make_unique<ControlService>(*store, *peers, metrics, std::chrono::milliseconds(100));
  }
  std::unique_ptr<Store> store;
  Metrics metrics;
  std::unique_ptr<PeerPool> peers;
  std::unique_ptr<ControlService> service;
  WakeFd stop;
};

// Rewrites the headers of the requests above, walking frame by frame as the service will;
// stops where it would stop (a header it cannot decode).
void DisarmPeerOps(std::vector<std::byte>& in) {
  size_t off = 0;
  while (in.size() - off >= kHeaderBytes) {
    auto h = DecodeHeader(in.data() + off, 4096);
    if (!h.ok()) return;
    if (h->op == Op::kPullFrom || h->op == Op::kPushTo || h->op == Op::kExistsAt) h->op = Op::kInfo;
    if (h->op == Op::kPin || h->op == Op::kRelease) h->status &= static_cast<uint16_t>(~kPinForHost);
    EncodeHeader(*h, in.data() + off);
    off += kHeaderBytes + h->body_len;
    if (off > in.size()) return;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static World* world = new World();
  if (size > 65536) return 0;
  std::vector<std::byte> in(reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + size);
  DisarmPeerOps(in);
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, fds) != 0) return 0;
  Socket client{UniqueFd(fds[0])}, server{UniqueFd(fds[1])};
  int big = 1 << 20;
  ::setsockopt(fds[0], SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
  ::setsockopt(fds[1], SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
  (void)client.WriteFull(in.data(), in.size(), Deadline::After(std::chrono::milliseconds(100)));
  ::shutdown(fds[0], SHUT_WR);
  {
    Connection conn(server, world->stop, "", [] { return Status::Ok(); });
    world->service->Serve(conn);  // returns at the end of the input or at its first bad frame
  }
  StoreStats st = world->store->Stats();
  if (st.pinned != 0) std::abort();  // the connection's pins went with it
  return 0;
}
