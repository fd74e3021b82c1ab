#include "net/server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "base/log.h"
#include "net/conn.h"

namespace tpusync::net {
namespace {

std::string SourceOf(const Socket& s) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  if (::getpeername(s.fd(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "";
  char buf[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&addr)->sin_addr, buf, sizeof buf);
  } else if (addr.ss_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&addr)->sin6_addr, buf, sizeof buf);
  }
  return buf;
}

}  // namespace

struct ConnectionServer::ConnState {
  Socket socket;
  std::string source;
  Clock::time_point accepted;
  std::thread thread;
  bool admitted = false;  // guarded by mu_, like the rest
  bool cut = false;
  bool done = false;
};

ConnectionServer::ConnectionServer(std::string name, Listener listener, Handler handler, ServerLimits limits,
                                   Refuser refuse)
    : name_(std::move(name)), listener_(std::move(listener)), port_(listener_.port()), handler_(std::move(handler)),
      limits_(limits), refuse_(refuse ? std::move(refuse) : RefuseWithErrorFrame) {}

ConnectionServer::~ConnectionServer() { Stop(std::chrono::milliseconds(0)); }

void ConnectionServer::Start() { acceptor_ = std::thread([this] { AcceptLoop(); }); }

size_t ConnectionServer::active() const {
  std::lock_guard lock(mu_);
  size_t n = 0;
  for (const auto& c : conns_) n += !c->done;
  return n;
}

Status ConnectionServer::Admit(ConnState& c) {
  std::lock_guard lock(mu_);
  if (c.cut) return ResourceExhausted("cut off while unauthenticated to make room for another connection");
  size_t admitted = 0, from_source = 0;
  for (const auto& o : conns_) {
    if (!o->admitted || o->done) continue;
    ++admitted;
    from_source += !c.source.empty() && o->source == c.source;
  }
  if (admitted >= limits_.max_admitted) {
    ++refused_;
    return ResourceExhausted("at its connection limit (" + std::to_string(admitted) + "); try again later");
  }
  if (from_source >= limits_.max_admitted_per_source) {
    ++refused_;
    return ResourceExhausted("holds " + std::to_string(from_source) + " connections from " + c.source +
                             ", the most one source may have; close idle ones or try again later");
  }
  c.admitted = true;
  return Status::Ok();
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
    std::string source = SourceOf(*s);
    std::lock_guard lock(mu_);
    size_t pending = 0, from_source = 0;
    ConnState* oldest = nullptr;
    for (auto it = conns_.begin(); it != conns_.end();) {
      ConnState& c = **it;
      if (c.done) {  // reap finished connections
        c.thread.join();
        it = conns_.erase(it);
        continue;
      }
      if (!c.admitted && !c.cut) {
        ++pending;
        from_source += !source.empty() && c.source == source;
        if (oldest == nullptr || c.accepted < oldest->accepted) oldest = &c;
      }
      ++it;
    }
    if (from_source >= limits_.max_pending_per_source) {
      ++refused_;
      Refuse(*s, "too many unauthenticated connections from " + source);
      continue;
    }
    if (pending >= limits_.max_pending) {
      if (oldest == nullptr || Clock::now() - oldest->accepted < limits_.pending_grace) {
        ++refused_;
        Refuse(*s, "too many unauthenticated connections");
        continue;
      }
      oldest->cut = true;  // its handler's next read fails and it returns
      oldest->socket.Shutdown();
      ++cut_pending_;
    }
    auto state = std::make_unique<ConnState>();
    state->socket = std::move(*s);
    state->source = std::move(source);
    state->accepted = Clock::now();
    ConnState* c = state.get();
    conns_.push_back(std::move(state));
    c->thread = std::thread([this, c] {
      Connection conn(c->socket, stop_, c->source, [this, c] { return Admit(*c); });
      handler_(conn);
      std::lock_guard l(mu_);
      c->socket.Close();
      c->done = true;
      cv_.notify_all();
    });
  }
}

void ConnectionServer::Refuse(Socket& s, const std::string& why) { refuse_(s, name_ + ": " + why + "; try again later"); }

// The frame fits an empty send buffer, and what the peer already sent is read away so that
// closing sends FIN rather than a reset that could discard the frame.
void RefuseWithErrorFrame(Socket& s, const std::string& why) {
  FramedConn conn(s, 0);
  if (!conn.SendError(ResourceExhausted(why), Deadline::After(std::chrono::milliseconds(10))).ok()) return;
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
  listener_.Close();
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
