// Non-blocking sockets whose every operation runs against one absolute deadline, so a slow
// or dead peer costs an operation its deadline, never a thread forever.
#pragma once

#include <sys/uio.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "base/posix_io.h"
#include "tpusync/status.h"

namespace tpusync::net {

using Clock = std::chrono::steady_clock;

class Deadline {
 public:
  static Deadline After(std::chrono::milliseconds d) { return Deadline(Clock::now() + d); }
  static Deadline Never() { return Deadline(Clock::time_point::max()); }
  static Deadline Earliest(Deadline a, Deadline b) { return a.at_ < b.at_ ? a : b; }
  bool expired() const { return Clock::now() >= at_; }
  // Milliseconds left for poll(): -1 for never, 0 when expired.
  int PollMs() const;

 private:
  explicit Deadline(Clock::time_point at) : at_(at) {}
  Clock::time_point at_;
};

class Socket {
 public:
  Socket() = default;
  explicit Socket(UniqueFd fd) : fd_(std::move(fd)) {}

  static Result<Socket> ConnectTcp(const std::string& host, uint16_t port, Deadline deadline);
  static Result<Socket> ConnectUnix(const std::string& path, Deadline deadline);

  // Each moves every byte or fails: kDeadlineExceeded, or kUnavailable when the peer is gone.
  Status ReadFull(void* dst, size_t len, Deadline deadline);
  Status WriteFull(const void* src, size_t len, Deadline deadline);
  Status WriteVFull(struct iovec* iov, int iovcnt, Deadline deadline);
  // Fills the iovecs in order with at least `min` bytes, and with whatever more has arrived
  // already, up to their total; returns how many. The iovecs are consumed as they fill.
  Result<size_t> ReadVAtLeast(struct iovec* iov, int iovcnt, size_t min, Deadline deadline);
  // Waits for input. Returns false if `wake_fd` (an eventfd; -1 for none) fired first.
  Result<bool> WaitReadable(int wake_fd, Deadline deadline);

  int fd() const { return fd_.get(); }
  bool valid() const { return fd_.valid(); }
  void Close() { fd_.reset(); }
  // Unblocks a thread in ReadFull/WriteFull on this socket from another thread.
  void Shutdown();

 private:
  Status Wait(short events, Deadline deadline);
  UniqueFd fd_;
};

class Listener {
 public:
  static Result<Listener> ListenTcp(const std::string& bind, uint16_t port);
  // Replaces a stale socket at `path`; kFailedPrecondition if something else is there.
  static Result<Listener> ListenUnix(const std::string& path);
  // Returns an accepted socket, or an invalid Socket if `wake_fd` fired.
  Result<Socket> Accept(int wake_fd);
  uint16_t port() const { return port_; }
  int fd() const { return fd_.get(); }
  // Stops listening: connections that arrive later are refused by the kernel.
  void Close() { fd_.reset(); }

 private:
  UniqueFd fd_;
  uint16_t port_ = 0;
  std::string unix_path_;
};

// An eventfd that wakes waiting threads (shutdown signal).
class WakeFd {
 public:
  WakeFd();
  void Fire();
  bool fired() const;
  int fd() const { return fd_.get(); }

 private:
  UniqueFd fd_;
};

// Splits "host:port" (or "[v6]:port"); kInvalidArgument if malformed.
Result<std::pair<std::string, uint16_t>> SplitHostPort(const std::string& addr);

}  // namespace tpusync::net
