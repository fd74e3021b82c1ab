// ConnectionServer: accepts connections and serves each on its own thread, so one slow or
// dead peer holds only its own thread; handshakes never queue behind data transfers.
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

class ConnectionServer {
 public:
  // The handler serves one connection until it returns; it should return promptly once
  // `stop` fires while the connection is idle.
  using Handler = std::function<void(Socket& socket, const WakeFd& stop)>;

  ConnectionServer(std::string name, Listener listener, Handler handler, size_t max_connections);
  ~ConnectionServer();  // Stop(0)
  ConnectionServer(const ConnectionServer&) = delete;
  ConnectionServer& operator=(const ConnectionServer&) = delete;

  void Start();
  // Stops accepting, lets idle connections go, waits up to `drain` for busy ones, then cuts
  // the rest off. Idempotent.
  void Stop(std::chrono::milliseconds drain);
  uint16_t port() const { return listener_.port(); }
  size_t active() const;
  uint64_t refused() const { return refused_.load(); }

 private:
  struct Conn {
    Socket socket;
    std::thread thread;
    bool done = false;  // guarded by mu_
  };
  void AcceptLoop();
  void Refuse(Socket& s);

  std::string name_;
  Listener listener_;
  Handler handler_;
  size_t max_connections_;
  WakeFd stop_;
  std::thread acceptor_;
  std::atomic<uint64_t> refused_{0};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::list<std::unique_ptr<Conn>> conns_;  // guarded by mu_
  bool stopped_ = false;                    // guarded by mu_
};

}  // namespace tpusync::net
