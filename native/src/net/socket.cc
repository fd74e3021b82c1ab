#include "net/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>

namespace tpusync::net {
namespace {

void Tune(int fd, bool tcp) {
  int one = 1;
  if (tcp) ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

Status PeerGone(std::string_view what, int err) {
  return {StatusCode::kUnavailable,
          std::string(what) + ": " + (err ? ErrnoMessage(err) : "peer closed the connection")};
}

// Drops the first `done` bytes from iov[*start...], as a partial readv or writev left them.
void Advance(struct iovec* iov, int iovcnt, int* start, size_t done) {
  while (*start < iovcnt && done >= iov[*start].iov_len) done -= iov[(*start)++].iov_len;
  if (*start < iovcnt) {
    iov[*start].iov_base = static_cast<char*>(iov[*start].iov_base) + done;
    iov[*start].iov_len -= done;
  }
}

}  // namespace

int Deadline::PollMs() const {
  if (at_ == Clock::time_point::max()) return -1;
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(at_ - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<long long>(left + 1, INT32_MAX));
}

Status Socket::Wait(short events, Deadline deadline) {
  for (;;) {
    struct pollfd p = {fd_.get(), events, 0};
    int n = ::poll(&p, 1, deadline.PollMs());
    if (n > 0) return Status::Ok();
    if (n == 0) return {StatusCode::kDeadlineExceeded, "socket operation passed its deadline"};
    if (errno != EINTR) return ErrnoStatus(errno, "poll");
  }
}

Status Socket::ReadFull(void* dst, size_t len, Deadline deadline) {
  struct iovec iov = {dst, len};
  return ReadVAtLeast(&iov, 1, len, deadline).status();
}

Result<size_t> Socket::ReadVAtLeast(struct iovec* iov, int iovcnt, size_t min, Deadline deadline) {
  size_t got = 0;
  int start = 0;
  while (got < min && start < iovcnt) {
    ssize_t n = ::readv(fd_.get(), iov + start, iovcnt - start);
    if (n > 0) {
      got += static_cast<size_t>(n);
      Advance(iov, iovcnt, &start, static_cast<size_t>(n));
    } else if (n == 0) {
      return PeerGone("read", 0);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      TPUSYNC_RETURN_IF_ERROR(Wait(POLLIN, deadline));
    } else if (errno != EINTR) {
      return PeerGone("read", errno);
    }
  }
  return got;
}

Status Socket::WriteVFull(struct iovec* iov, int iovcnt, Deadline deadline) {
  int start = 0;
  while (start < iovcnt) {
    struct msghdr msg {};
    msg.msg_iov = iov + start;
    msg.msg_iovlen = static_cast<size_t>(iovcnt - start);
    ssize_t n = ::sendmsg(fd_.get(), &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        TPUSYNC_RETURN_IF_ERROR(Wait(POLLOUT, deadline));
        continue;
      }
      if (errno == EINTR) continue;
      return PeerGone("write", errno);
    }
    Advance(iov, iovcnt, &start, static_cast<size_t>(n));
  }
  return Status::Ok();
}

Status Socket::WriteFull(const void* src, size_t len, Deadline deadline) {
  struct iovec iov = {const_cast<void*>(src), len};
  return WriteVFull(&iov, 1, deadline);
}

Result<bool> Socket::WaitReadable(int wake_fd, Deadline deadline) {
  for (;;) {
    struct pollfd p[2] = {{fd_.get(), POLLIN, 0}, {wake_fd, POLLIN, 0}};
    int n = ::poll(p, wake_fd >= 0 ? 2 : 1, deadline.PollMs());
    if (n == 0) return Status(StatusCode::kDeadlineExceeded, "idle connection passed its deadline");
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "poll");
    }
    if (p[0].revents) return true;
    return false;
  }
}

void Socket::Shutdown() {
  if (fd_.valid()) ::shutdown(fd_.get(), SHUT_RDWR);
}

Result<Socket> Socket::ConnectTcp(const std::string& host, uint16_t port, Deadline deadline) {
  struct addrinfo hints {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  struct addrinfo* res = nullptr;
  std::string port_s = std::to_string(port);
  const std::string target = "connect " + host + ":" + port_s;
  if (int err = ::getaddrinfo(host.c_str(), port_s.c_str(), &hints, &res); err != 0) {
    return Status(StatusCode::kUnavailable, "resolve " + host + ": " + ::gai_strerror(err));
  }
  Status last(StatusCode::kUnavailable, "no address for " + host);
  for (auto* ai = res; ai != nullptr; ai = ai->ai_next) {
    UniqueFd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol));
    if (!fd.valid()) continue;
    Tune(fd.get(), true);
    Socket s(std::move(fd));
    int rc = ::connect(s.fd(), ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      Status st = s.Wait(POLLOUT, deadline);
      int err = 0;
      socklen_t l = sizeof(err);
      if (st.ok()) ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &l);
      if (!st.ok()) {
        last = st;
        continue;
      }
      if (err != 0) {
        last = PeerGone(target, err);
        continue;
      }
      rc = 0;
    }
    if (rc == 0) {
      ::freeaddrinfo(res);
      return s;
    }
    last = PeerGone(target, errno);
  }
  ::freeaddrinfo(res);
  return last;
}

Result<Socket> Socket::ConnectUnix(const std::string& path, Deadline deadline) {
  struct sockaddr_un addr {};
  if (path.size() >= sizeof(addr.sun_path)) return InvalidArgument("socket path too long: " + path);
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoStatus(errno, "socket");
  Socket s(std::move(fd));
  if (::connect(s.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    int err = errno;  // before the message's allocation
    if (err != EINPROGRESS && err != EAGAIN) return PeerGone("connect " + path, err);
    TPUSYNC_RETURN_IF_ERROR(s.Wait(POLLOUT, deadline));
  }
  return s;
}

Result<Listener> Listener::ListenTcp(const std::string& bind, uint16_t port) {
  struct addrinfo hints {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICHOST;
  struct addrinfo* res = nullptr;
  if (int err = ::getaddrinfo(bind.c_str(), std::to_string(port).c_str(), &hints, &res); err != 0) {
    return InvalidArgument("bind address " + bind + ": " + ::gai_strerror(err));
  }
  Listener l;
  l.fd_.reset(::socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  int one = 1;
  ::setsockopt(l.fd_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  int rc = ::bind(l.fd_.get(), res->ai_addr, res->ai_addrlen);
  ::freeaddrinfo(res);
  if (rc != 0) return ErrnoStatus(errno, "bind " + bind + ":" + std::to_string(port));
  if (::listen(l.fd_.get(), 512) != 0) return ErrnoStatus(errno, "listen");
  struct sockaddr_storage ss {};
  socklen_t len = sizeof(ss);
  ::getsockname(l.fd_.get(), reinterpret_cast<sockaddr*>(&ss), &len);
  l.port_ = ntohs(ss.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&ss)->sin_port
                                          : reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  return l;
}

Result<Listener> Listener::ListenUnix(const std::string& path) {
  struct sockaddr_un addr {};
  if (path.size() >= sizeof(addr.sun_path)) return InvalidArgument("socket path too long: " + path);
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  struct stat existing {};
  if (::lstat(path.c_str(), &existing) == 0) {
    if (!S_ISSOCK(existing.st_mode)) {
      return FailedPrecondition(path + " exists and is not a socket; refusing to replace it");
    }
    ::unlink(path.c_str());  // a stale socket from a previous run
  }
  Listener l;
  l.fd_.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (::bind(l.fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoStatus(errno, "bind " + path);
  }
  ::chmod(path.c_str(), 0600);  // only this user's engines may use the control channel
  if (::listen(l.fd_.get(), 128) != 0) return ErrnoStatus(errno, "listen " + path);
  l.unix_path_ = path;
  return l;
}

Result<Socket> Listener::Accept(int wake_fd) {
  for (;;) {
    struct pollfd p[2] = {{fd_.get(), POLLIN, 0}, {wake_fd, POLLIN, 0}};
    if (::poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "poll listener");
    }
    if (p[1].revents) return Socket();
    int fd = ::accept4(fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      Tune(fd, unix_path_.empty());
      return Socket(UniqueFd(fd));
    }
    if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) return ErrnoStatus(errno, "accept");
  }
}

WakeFd::WakeFd() : fd_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}

void WakeFd::Fire() {
  uint64_t one = 1;
  (void)!::write(fd_.get(), &one, sizeof(one));
}

bool WakeFd::fired() const {
  struct pollfd p = {fd_.get(), POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

Result<std::pair<std::string, uint16_t>> SplitHostPort(const std::string& addr) {
  size_t colon = addr.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == addr.size()) {
    return InvalidArgument("peer address '" + addr + "' is not host:port");
  }
  std::string host = addr.substr(0, colon);
  if (host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  char* end = nullptr;
  long port = std::strtol(addr.c_str() + colon + 1, &end, 10);
  if (*end != '\0' || port <= 0 || port > 65535) return InvalidArgument("peer address '" + addr + "' has a bad port");
  return std::make_pair(host, static_cast<uint16_t>(port));
}

}  // namespace tpusync::net
