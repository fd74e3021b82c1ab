// ConnectionServer: accepts connections and serves each on its own thread, so one slow or
// dead peer holds only its own thread; handshakes never queue behind data transfers.
//
// A connection starts pending and becomes admitted when its handler calls Admit() (after the
// handshake, or after an HTTP request head arrived). Pending and admitted connections have
// separate budgets, so connections that never prove anything cannot take the slots of
// authenticated peers; both are limited per source address, and when the pending
// budget is full the oldest pending connection (if older than `pending_grace`) is cut off to
// make room, so holding idle connections cannot lock anyone out.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "net/socket.h"

namespace tpusync::net {

struct ServerLimits {
  size_t max_admitted = 256;
  // Admitted connections from one source address: one peer, however authenticated, cannot hold
  // the whole admitted budget. Not applied to UNIX sockets (no source address).
  size_t max_admitted_per_source = 64;
  size_t max_pending = 64;
  size_t max_pending_per_source = 8;  // not applied to UNIX sockets (no source address)
  std::chrono::milliseconds pending_grace{0};
};

// What a handler gets for one connection. Borrows everything; lives as long as the handler.
class Connection {
 public:
  Connection(Socket& socket, const WakeFd& stop, std::string source, std::function<Status()> admit)
      : socket_(socket), stop_(stop), source_(std::move(source)), admit_(std::move(admit)) {}
  Socket& socket() { return socket_; }
  const WakeFd& stop() const { return stop_; }
  // "ip" of the peer, or "" for a UNIX socket.
  const std::string& source() const { return source_; }
  // Moves the connection into the admitted budget; kResourceExhausted (serve nothing more),
  // naming the budget, when that is full or the connection was cut off while pending.
  Status Admit() { return admit_(); }

 private:
  Socket& socket_;
  const WakeFd& stop_;
  std::string source_;
  std::function<Status()> admit_;
};

class ConnectionServer {
 public:
  // The handler serves one connection until it returns; it should return promptly once
  // `stop` fires while the connection is idle.
  using Handler = std::function<void(Connection& conn)>;
  // Tells a refused connection why, without waiting on it (the acceptor must not stall).
  using Refuser = std::function<void(Socket& socket, const std::string& why)>;

  ConnectionServer(std::string name, Listener listener, Handler handler, ServerLimits limits,
                   Refuser refuse = nullptr);
  ~ConnectionServer();  // Stop(0)
  ConnectionServer(const ConnectionServer&) = delete;
  ConnectionServer& operator=(const ConnectionServer&) = delete;

  void Start();
  // Stops accepting (the listener closes, so new connections are refused, not queued), lets
  // idle connections go, waits up to `drain` for busy ones, then cuts the rest off. Idempotent.
  void Stop(std::chrono::milliseconds drain);
  uint16_t port() const { return port_; }
  size_t active() const;
  uint64_t refused() const { return refused_.load(); }
  uint64_t cut_pending() const { return cut_pending_.load(); }

 private:
  void AcceptLoop();
  struct ConnState;
  void Refuse(Socket& s, const std::string& why);
  Status Admit(ConnState& c);

  std::string name_;
  Listener listener_;
  uint16_t port_;
  Handler handler_;
  ServerLimits limits_;
  Refuser refuse_;
  WakeFd stop_;
  std::thread acceptor_;
  std::atomic<uint64_t> refused_{0}, cut_pending_{0};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::list<std::unique_ptr<ConnState>> conns_;  // guarded by mu_
  bool stopped_ = false;                         // guarded by mu_
};

// The default refusal: an ERROR frame, which a tpusync client reads in place of a reply.
void RefuseWithErrorFrame(Socket& s, const std::string& why);

}  // namespace tpusync::net
