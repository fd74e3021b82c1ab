// PeerService: the data port. Serves EXISTS, PULL and PUSH from authenticated peers straight
// out of and into pool slots.
#pragma once

#include <chrono>

#include "net/conn.h"
#include "sidecar/metrics.h"
#include "tpusync/store.h"

namespace tpusync::net {

struct PeerServiceOptions {
  std::chrono::milliseconds handshake_timeout{5000};
  std::chrono::milliseconds op_timeout{120000};
  std::chrono::milliseconds idle_timeout{600000};
};

class PeerService {
 public:
  PeerService(Store& store, Secret secret, Metrics& metrics, PeerServiceOptions options)
      : store_(store), secret_(std::move(secret)), metrics_(metrics), options_(options) {}

  // Serves one connection: handshake, then requests until the peer leaves, a frame is bad,
  // or `stop` fires while idle. Never throws; every failure closes only this connection.
  void Serve(Socket& socket, const WakeFd& stop);

 private:
  Status HandleExists(FramedConn& c, const Frame& f, Deadline d);
  Status HandlePull(FramedConn& c, const Frame& f, Deadline d);
  Status HandlePush(FramedConn& c, const Frame& f, Deadline d);

  Store& store_;
  Secret secret_;
  Metrics& metrics_;
  PeerServiceOptions options_;
};

}  // namespace tpusync::net
