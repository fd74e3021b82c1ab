// PeerService: the data port. Serves EXISTS, PULL and PUSH from authenticated peers straight
// out of and into pool slots.
#pragma once

#include <chrono>
#include <mutex>
#include <string>
#include <unordered_map>

#include "net/conn.h"
#include "net/server.h"
#include "net/metrics.h"
#include "tpusync/store.h"

namespace tpusync::net {

struct PeerServiceOptions {
  std::chrono::milliseconds handshake_timeout{2000};
  std::chrono::milliseconds op_timeout{120000};
  std::chrono::milliseconds idle_timeout{600000};
  // Each frame of a request must move whole within this (FramedConn::set_progress_timeout).
  std::chrono::milliseconds progress_timeout{10000};
  bool encrypt = false;  // require encrypted sessions
};

class PeerService {
 public:
  PeerService(Store& store, Secret secret, Metrics& metrics, PeerServiceOptions options)
      : store_(store), secret_(std::move(secret)), metrics_(metrics), options_(options) {}

  // Serves one connection: handshake, admission, then requests until the peer leaves, a
  // frame is bad, or `stop` fires while idle. Never throws; every failure closes only this
  // connection.
  void Serve(Connection& conn);

 private:
  Status HandleExists(FramedConn& c, const Frame& f, Deadline d);
  Status HandlePull(FramedConn& c, const Frame& f, Deadline d);
  Status HandlePush(FramedConn& c, const Frame& f, Deadline d);

  // Logs a refused handshake at most once per source per interval, with the count skipped.
  void LogRefused(const std::string& source, const Status& why);

  Store& store_;
  Secret secret_;
  Metrics& metrics_;
  PeerServiceOptions options_;
  struct RefusalLog {
    Clock::time_point last;
    uint64_t skipped = 0;
  };
  std::mutex log_mu_;
  std::unordered_map<std::string, RefusalLog> refusals_;  // guarded by log_mu_
};

}  // namespace tpusync::net
