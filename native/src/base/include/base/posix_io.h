// Move-only owners of file descriptors and memory mappings, and full-length vector I/O.
#pragma once

#include <sys/uio.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "tpusync/status.h"

namespace tpusync {

// strerror(err), thread-safe (std::strerror may share one buffer between threads).
std::string ErrnoMessage(int err);

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(std::exchange(o.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

class Mapping {
 public:
  Mapping() = default;
  Mapping(void* addr, size_t len) : addr_(addr), len_(len) {}
  Mapping(Mapping&& o) noexcept : addr_(std::exchange(o.addr_, nullptr)), len_(std::exchange(o.len_, 0)) {}
  Mapping& operator=(Mapping&& o) noexcept;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { reset(); }

  std::byte* data() const { return static_cast<std::byte*>(addr_); }
  size_t size() const { return len_; }
  void reset();

 private:
  void* addr_ = nullptr;
  size_t len_ = 0;
};

// Page-aligned heap memory for O_DIRECT staging, freed on destruction.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t len);
  AlignedBuffer(AlignedBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), len_(o.len_) {}
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();
  std::byte* data() const { return p_; }
  size_t size() const { return len_; }

 private:
  std::byte* p_;
  size_t len_;
};

// Writes (reads) every byte of iov at offset, retrying on EINTR and short transfers.
// A read that meets end of file returns kDataLoss ("truncated"); `what` names the file.
Status PwritevFull(int fd, struct iovec* iov, int iovcnt, uint64_t offset, const std::string& what);
Status PreadvFull(int fd, struct iovec* iov, int iovcnt, uint64_t offset, const std::string& what);

constexpr uint64_t kPageBytes = 4096;
constexpr uint64_t kHugePageBytes = 2ull << 20;
constexpr uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace tpusync
