#include "base/posix_io.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>

namespace tpusync {

std::string ErrnoMessage(int err) {
  char buf[128];
  return ::strerror_r(err, buf, sizeof(buf));  // GNU strerror_r: returns the message, in buf or static
}

Mapping& Mapping::operator=(Mapping&& o) noexcept {
  if (this != &o) {
    reset();
    addr_ = std::exchange(o.addr_, nullptr);
    len_ = std::exchange(o.len_, 0);
  }
  return *this;
}

void Mapping::reset() {
  if (addr_ != nullptr) ::munmap(addr_, len_);
  addr_ = nullptr;
  len_ = 0;
}

AlignedBuffer::AlignedBuffer(size_t len) : len_(len) {
  p_ = static_cast<std::byte*>(std::aligned_alloc(kPageBytes, AlignUp(len, kPageBytes)));
  if (p_ == nullptr) throw std::bad_alloc();
}

AlignedBuffer::~AlignedBuffer() { std::free(p_); }

namespace {

// Advances iov past `done` bytes; returns the new start index.
int Consume(struct iovec* iov, int iovcnt, int start, size_t done) {
  while (start < iovcnt && done >= iov[start].iov_len) {
    done -= iov[start].iov_len;
    iov[start].iov_len = 0;
    ++start;
  }
  if (start < iovcnt) {
    iov[start].iov_base = static_cast<char*>(iov[start].iov_base) + done;
    iov[start].iov_len -= done;
  }
  return start;
}

template <typename Op>
Status VectorIo(Op op, int fd, struct iovec* iov, int iovcnt, uint64_t offset, const std::string& what,
                bool is_read) {
  int start = 0;
  while (start < iovcnt) {
    ssize_t n = op(fd, iov + start, iovcnt - start, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, (is_read ? "read " : "write ") + what);
    }
    if (n == 0) {
      if (is_read) return DataLoss("truncated: " + what + " ends before offset " + std::to_string(offset));
      return ErrnoStatus(ENOSPC, "write " + what);
    }
    offset += static_cast<uint64_t>(n);
    start = Consume(iov, iovcnt, start, static_cast<size_t>(n));
  }
  return Status::Ok();
}

}  // namespace

Status PwritevFull(int fd, struct iovec* iov, int iovcnt, uint64_t offset, const std::string& what) {
  return VectorIo(::pwritev, fd, iov, iovcnt, offset, what, false);
}

Status PreadvFull(int fd, struct iovec* iov, int iovcnt, uint64_t offset, const std::string& what) {
  return VectorIo(::preadv, fd, iov, iovcnt, offset, what, true);
}

}  // namespace tpusync
