#include "net/server.h"

#include <sys/socket.h>

#include "log.h"
#include "net/conn.h"

namespace tpusync::net {

ConnectionServer::ConnectionServer(std::string name, Listener listener, Handler handler, size_t max_connections)
    : name_(std::move(name)), listener_(std::move(listener)), handler_(std::move(handler)),
      max_connections_(max_connections) {}

ConnectionServer::~ConnectionServer() { Stop(std::chrono::milliseconds(0)); }

void ConnectionServer::Start() { acceptor_ = std::thread([this] { AcceptLoop(); }); }

size_t ConnectionServer::active() const {
  std::lock_guard lock(mu_);
  size_t n = 0;
  for (const auto& c : conns_) n += !c->done;
  return n;
}

void ConnectionServer::AcceptLoop() {
  for (;;) {
    Result<Socket> s = listener_.Accept(stop_.fd());
    if (!s.ok()) {
      Log(LogLevel::kWarning, name_, "accept: " + s.status().ToString());
      if (stop_.fired()) return;
      continue;
    }
    if (!s->valid()) return;  // stopping
    std::lock_guard lock(mu_);
    for (auto it = conns_.begin(); it != conns_.end();) {  // reap finished connections
      if ((*it)->done) {
        (*it)->thread.join();
        it = conns_.erase(it);
      } else {
        ++it;
      }
    }
    if (conns_.size() >= max_connections_) {
      ++refused_;
      Refuse(*s);
      continue;  // the socket closes here
    }
    auto conn = std::make_unique<Conn>();
    conn->socket = std::move(*s);
    Conn* c = conn.get();
    conns_.push_back(std::move(conn));
    c->thread = std::thread([this, c] {
      handler_(c->socket, stop_);
      std::lock_guard l(mu_);
      c->socket.Close();
      c->done = true;
      cv_.notify_all();
    });
  }
}

// Tells a peer over the limit why it is not served: an ERROR frame, which its client reads in
// place of the handshake's reply. Nothing here waits on the peer (the acceptor must not
// stall): the frame fits an empty send buffer, and what the peer already sent is read away
// so that closing sends FIN rather than a reset that could discard the frame.
void ConnectionServer::Refuse(Socket& s) {
  FramedConn conn(s, 0);
  Status st = ResourceExhausted(name_ + ": at its connection limit (" + std::to_string(max_connections_) +
                                "); try again later");
  if (!conn.SendError(st, Deadline::After(std::chrono::milliseconds(10))).ok()) return;
  std::byte sink[4096];
  for (int i = 0; i < 16 && ::recv(s.fd(), sink, sizeof sink, MSG_DONTWAIT) > 0; ++i) {
  }
  ::shutdown(s.fd(), SHUT_WR);
}

void ConnectionServer::Stop(std::chrono::milliseconds drain) {
  {
    std::lock_guard lock(mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  stop_.Fire();
  if (acceptor_.joinable()) acceptor_.join();
  std::unique_lock lock(mu_);
  auto all_done = [&] {
    for (const auto& c : conns_) {
      if (!c->done) return false;
    }
    return true;
  };
  if (!cv_.wait_for(lock, drain, all_done)) {
    size_t cut = 0;
    for (auto& c : conns_) {
      if (!c->done) c->socket.Shutdown(), ++cut;
    }
    Log(LogLevel::kWarning, name_, std::to_string(cut) + " connections still busy after the drain period were cut off");
  }
  cv_.wait(lock, all_done);
  for (auto& c : conns_) c->thread.join();
  conns_.clear();
}

}  // namespace tpusync::net
