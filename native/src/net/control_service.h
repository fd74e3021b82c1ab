// ControlService: the UNIX-socket control channel for engines in the same pod. Engines map
// the pool file and move bytes themselves; this channel hands out slots and pins, and asks
// the sidecar to pull from or push to peers. Leases and pins die with the connection that took
// them, except pins taken for the host (kPinForHost).
#pragma once

#include <chrono>
#include <string>

#include "net/conn.h"
#include "net/peer_client.h"
#include "sidecar/metrics.h"
#include "tpusync/store.h"

namespace tpusync::net {

// Reserve/acquire result codes in a kSlots reply.
enum SlotResult : uint8_t { kSlotOk = 0, kSlotAlreadyStored = 1, kSlotNoRoom = 2, kSlotMissing = 3 };
// PIN / RELEASE header status flag: a pin held for the host, not the connection.
constexpr uint16_t kPinForHost = 1;

class ControlService {
 public:
  ControlService(Store& store, PeerPool& peers, Metrics& metrics, std::chrono::milliseconds op_timeout)
      : store_(store), peers_(peers), metrics_(metrics), op_timeout_(op_timeout) {}
  void Serve(Socket& socket, const WakeFd& stop);

 private:
  struct Session;
  Status Handle(FramedConn& c, const Frame& f, Session& session, Deadline d);
  Status HandlePeerOp(FramedConn& c, const Frame& f, Deadline d);

  Store& store_;
  PeerPool& peers_;
  Metrics& metrics_;
  std::chrono::milliseconds op_timeout_;
};

}  // namespace tpusync::net
