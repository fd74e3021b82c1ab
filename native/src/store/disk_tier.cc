#include "store/disk_tier.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <unordered_map>

#include "base/checksum.h"
#include "base/log.h"
#include "base/posix_io.h"

namespace tpusync {
namespace {

constexpr uint64_t kMagic = 0x54505553594e4458ULL;  // "TPUSYNDX"
constexpr uint32_t kVersion = 1;
constexpr uint64_t kHeaderBytes = kPageBytes;       // keeps payloads aligned for O_DIRECT

struct ExtentHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t reserved;
  uint64_t block_bytes;
  uint64_t key_hi;
  uint64_t key_lo;
  uint64_t length;
  uint64_t seq;
  uint64_t payload_sum;
  uint64_t header_sum;  // over every field above
};

bool HeaderValid(const ExtentHeader& h, uint64_t block_bytes) {
  return h.magic == kMagic && h.version == kVersion && h.block_bytes == block_bytes && h.length > 0 &&
         h.length <= block_bytes && h.header_sum == HeaderSum(h);
}

}  // namespace

uint64_t DiskTier::offset(uint32_t extent) const { return uint64_t{extent} * (kHeaderBytes + block_bytes_); }

Result<std::unique_ptr<DiskTier>> DiskTier::Open(const DiskTierOptions& o) {
  if (o.block_bytes == 0 || o.block_bytes % kPageBytes != 0) {
    return InvalidArgument("disk tier block_bytes " + std::to_string(o.block_bytes) + " is not a multiple of 4096");
  }
  const uint64_t extent_bytes = kHeaderBytes + o.block_bytes;
  const uint64_t n = o.capacity_bytes / o.block_bytes;
  if (n == 0) return InvalidArgument("disk tier capacity is smaller than one block");
  if (n > UINT32_MAX) return InvalidArgument("disk tier capacity exceeds 2^32-1 blocks");

  std::error_code ec;
  std::filesystem::create_directories(o.dir, ec);
  if (ec) return Status(StatusCode::kIoError, "create disk tier directory " + o.dir + ": " + ec.message());

  std::unique_ptr<DiskTier> t(new DiskTier());
  t->block_bytes_ = o.block_bytes;
  t->num_extents_ = static_cast<uint32_t>(n);
  t->path_ = o.dir + "/extents.dat";

  const std::string lock_path = o.dir + "/tier.lock";
  t->lock_fd_.reset(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (!t->lock_fd_.valid()) return ErrnoStatus(errno, "open " + lock_path);
  if (::flock(t->lock_fd_.get(), LOCK_EX | LOCK_NB) != 0) {
    return FailedPrecondition("disk tier " + o.dir + " is owned by another process");
  }

  // The geometry is recorded beside the extents: reopening with another block size would
  // misread every extent and then overwrite them, so it is refused instead.
  const std::string meta_path = o.dir + "/tier.meta";
  const std::string meta = "tpusync disk tier 1, block_bytes " + std::to_string(o.block_bytes) + "\n";
  if (std::ifstream in(meta_path); in) {
    std::string got;
    std::getline(in, got);
    if (got + "\n" != meta) {
      return FailedPrecondition("disk tier " + o.dir + " was written as \"" + got + "\", opened with block_bytes " +
                                std::to_string(o.block_bytes) + ": use the same block size or another directory");
    }
  } else if (!(std::ofstream(meta_path) << meta)) {
    return Status(StatusCode::kIoError, "write " + meta_path);
  }

  int flags = O_RDWR | O_CREAT | O_CLOEXEC;
  if (o.direct_io) t->fd_.reset(::open(t->path_.c_str(), flags | O_DIRECT, 0600));
  t->direct_io_ = t->fd_.valid();
  if (!t->fd_.valid()) t->fd_.reset(::open(t->path_.c_str(), flags, 0600));
  if (!t->fd_.valid()) return ErrnoStatus(errno, "open disk tier file " + t->path_);

  struct stat st{};
  if (::fstat(t->fd_.get(), &st) != 0) return ErrnoStatus(errno, "stat " + t->path_);
  const uint64_t want = n * extent_bytes;
  if (S_ISREG(st.st_mode) && static_cast<uint64_t>(st.st_size) < want) {
    struct statvfs vfs{};
    if (::statvfs(o.dir.c_str(), &vfs) == 0) {
      uint64_t avail = uint64_t{vfs.f_bavail} * vfs.f_frsize;
      uint64_t missing = want - static_cast<uint64_t>(st.st_blocks) * 512;
      if (missing > avail) {
        return ResourceExhausted("disk tier " + o.dir + " needs " + std::to_string(missing) + " more bytes, the filesystem has " +
                                 std::to_string(avail) + " free");
      }
    }
    // Reserve the space up front so a full disk shows up here rather than mid-eviction.
    if (::fallocate(t->fd_.get(), 0, 0, static_cast<off_t>(want)) != 0 && errno != EOPNOTSUPP) {
      return ErrnoStatus(errno, "reserve " + std::to_string(want) + " bytes for " + t->path_);
    }
  }

  // Recovery: scan every header. Unwritten extents read as zeros and are simply free.
  AlignedBuffer hdr(kHeaderBytes);
  std::vector<RecoveredExtent> found;
  std::vector<uint32_t> free;
  for (uint32_t e = 0; e < t->num_extents_; ++e) {
    ssize_t r = ::pread(t->fd_.get(), hdr.data(), kHeaderBytes, static_cast<off_t>(t->offset(e)));
    const auto* h = reinterpret_cast<const ExtentHeader*>(hdr.data());
    if (r == static_cast<ssize_t>(kHeaderBytes) && HeaderValid(*h, o.block_bytes)) {
      found.push_back({e, {h->key_hi, h->key_lo}, h->length, h->seq});
    } else {
      if (r == static_cast<ssize_t>(kHeaderBytes) && h->magic == kMagic) ++t->damaged_at_open_;
      free.push_back(e);
    }
  }
  std::reverse(free.begin(), free.end());  // hand out low extents first
  t->free_.Assign(std::move(free));
  std::sort(found.begin(), found.end(), [](auto& a, auto& b) { return a.seq < b.seq; });
  // The same key in two extents (an old copy whose slot was later reused for it): keep the newest.
  std::vector<RecoveredExtent> unique;
  {
    std::unordered_map<BlockKey, size_t, BlockKeyHash> pos;
    for (auto& r : found) {
      auto [it, inserted] = pos.try_emplace(r.key, unique.size());
      if (inserted) {
        unique.push_back(r);
      } else {
        t->free_.Give(unique[it->second].extent);
        unique[it->second] = r;
      }
    }
  }
  std::sort(unique.begin(), unique.end(), [](auto& a, auto& b) { return a.seq < b.seq; });
  t->recovered_ = std::move(unique);
  return t;
}

DiskTier::~DiskTier() = default;

std::optional<uint32_t> DiskTier::Allocate() {
  return free_.Take();
}

// The header is erased before the extent is reused, so a block that was evicted (or failed
// verification) is not found again by the recovery scan after a restart.
void DiskTier::Free(uint32_t extent) {
  AlignedBuffer hdr(kHeaderBytes);
  std::memset(hdr.data(), 0, kHeaderBytes);
  struct iovec iov = {hdr.data(), kHeaderBytes};
  Status st = PwritevFull(fd_.get(), &iov, 1, offset(extent), path_);
  if (!st.ok()) Log(LogLevel::kWarning, "disk", "erasing a freed extent's header: " + st.ToString());
  free_.Give(extent);
}

Status DiskTier::Write(uint32_t extent, const BlockKey& key, const std::byte* src, uint64_t length, uint64_t seq) {
  if (extent >= num_extents_ || length == 0 || length > block_bytes_) {
    return InvalidArgument("disk write: bad extent " + std::to_string(extent) + " or length " + std::to_string(length));
  }
  AlignedBuffer hdr(kHeaderBytes);
  std::memset(hdr.data(), 0, kHeaderBytes);
  auto* h = reinterpret_cast<ExtentHeader*>(hdr.data());
  *h = ExtentHeader{kMagic, kVersion, 0, block_bytes_, key.hi, key.lo, length, seq, Checksum(src, length), 0};
  h->header_sum = HeaderSum(*h);
  struct iovec iov[2] = {{hdr.data(), kHeaderBytes}, {const_cast<std::byte*>(src), block_bytes_}};
  return PwritevFull(fd_.get(), iov, 2, offset(extent), path_);
}

Status DiskTier::Read(uint32_t extent, const BlockKey& key, uint64_t length, std::byte* dst) {
  if (extent >= num_extents_) return InvalidArgument("disk read: bad extent " + std::to_string(extent));
  AlignedBuffer hdr(kHeaderBytes);
  struct iovec iov[2] = {{hdr.data(), kHeaderBytes}, {dst, block_bytes_}};
  TPUSYNC_RETURN_IF_ERROR(PreadvFull(fd_.get(), iov, 2, offset(extent), path_));
  const auto* h = reinterpret_cast<const ExtentHeader*>(hdr.data());
  const std::string where = path_ + " extent " + std::to_string(extent) + " (block " + key.ToHex() + ")";
  if (!HeaderValid(*h, block_bytes_)) return DataLoss("damaged header at " + where);
  if (h->key_hi != key.hi || h->key_lo != key.lo || h->length != length) {
    return DataLoss("header names another block at " + where);
  }
  if (Checksum(dst, length) != h->payload_sum) return DataLoss("payload checksum mismatch at " + where);
  return Status::Ok();
}

}  // namespace tpusync
