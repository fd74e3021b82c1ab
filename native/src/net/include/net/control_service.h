// ControlService: the UNIX-socket control channel for engines in the same pod. Engines map
// the pool file and move bytes themselves; this channel hands out slots and pins, and asks
// the sidecar to pull from or push to peers. Leases and pins die with the connection that took
// them, except pins taken for the host (kPinForHost).
#pragma once

#include <chrono>
#include <map>
#include <mutex>
#include <string>

#include "net/conn.h"
#include "net/peer_client.h"
#include "net/server.h"
#include "net/metrics.h"
#include "tpusync/store.h"

namespace tpusync::net {

// Reserve/acquire result codes in a kSlots reply.
// kSlotBusy: another connection holds a reservation of the key; ask again holding none.
enum SlotResult : uint8_t { kSlotOk = 0, kSlotAlreadyStored = 1, kSlotNoRoom = 2, kSlotMissing = 3, kSlotBusy = 4 };
// PIN / RELEASE header status flag: a pin held for the host, not the connection.
constexpr uint16_t kPinForHost = 1;
// LOOKUP header status flags: pin the prefix; or the tier of every key, the shared tier asked
// about each (Store::Where), nothing pinned.
constexpr uint16_t kLookupPin = 1;
constexpr uint16_t kLookupEveryKey = 2;
// PULL_FROM header status flag: reply with the XXH3-64 of each block that landed.
constexpr uint16_t kWantDigests = 1;

bool KeyLess(const BlockKey& a, const BlockKey& b);

class ControlService {
 public:
  ControlService(Store& store, PeerPool& peers, Metrics& metrics, std::chrono::milliseconds op_timeout)
      : store_(store), peers_(peers), metrics_(metrics), op_timeout_(op_timeout), host_pins_(&KeyLess) {}
  void Serve(Connection& conn);

 private:
  struct Session;
  // One request of a connection, and what answering it needs.
  struct Request {
    FramedConn& c;
    const Frame& f;
    Session& session;
    Deadline d;          // the reply's
    const WakeFd& stop;  // the sidecar stopping
  };
  // The control channel's operations, one handler each (docs/wire-protocol.md, "Control
  // channel requests"); HandlerFor is their table.
  using Handler = Status (ControlService::*)(Request&);
  static Handler HandlerFor(Op op);
  Status Info(Request& r);
  Status Lookup(Request& r);
  Status Pin(Request& r);
  Status Release(Request& r);
  Status Evict(Request& r);
  Status Flush(Request& r);
  Status Stats(Request& r);
  Status Reserve(Request& r);
  Status Commit(Request& r);
  Status Abort(Request& r);
  Status Acquire(Request& r);
  Status Unacquire(Request& r);
  Status Changes(Request& r);
  Status Describe(Request& r);
  Status Records(Request& r);
  Status PeerOp(Request& r);

  Status PinForHost(std::span<const BlockKey> keys);
  Status ReleaseForHost(std::span<const BlockKey> keys);

  Store& store_;
  PeerPool& peers_;
  Metrics& metrics_;
  std::chrono::milliseconds op_timeout_;
  std::mutex host_mu_;
  // Pins taken for the host (kPinForHost): only these can be released for the host.
  std::map<BlockKey, uint32_t, bool (*)(const BlockKey&, const BlockKey&)> host_pins_;  // guarded by host_mu_
};

}  // namespace tpusync::net
