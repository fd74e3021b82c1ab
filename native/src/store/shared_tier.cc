#include "tpusync/shared_tier.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string_view>
#include <unordered_set>

#include "base/checksum.h"
#include "base/log.h"
#include "base/posix_io.h"

namespace tpusync {
namespace {

// A block file's name: its key as BlockKey::ToHex writes it.
bool KeyFromHex(std::string_view hex, BlockKey* key) {
  if (hex.size() != 32) return false;
  uint64_t half[2] = {0, 0};
  for (size_t i = 0; i < 32; ++i) {
    const char c = hex[i];
    const int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (v < 0) return false;
    half[i / 16] = half[i / 16] << 4 | static_cast<uint64_t>(v);
  }
  *key = {half[0], half[1]};
  return true;
}

constexpr uint64_t kMagic = 0x54505553594e5348ULL;  // "TPUSYNSH"
constexpr uint32_t kVersion = 1;
constexpr uint64_t kHeaderBytes = kPageBytes;  // keeps the payload aligned for O_DIRECT
constexpr const char* kTop = "tpusync-shared-v1";
constexpr int64_t kAtimeGranularitySeconds = 60;

struct FileHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t reserved;
  uint64_t block_bytes;
  uint64_t fingerprint;
  uint64_t key_hi;
  uint64_t key_lo;
  uint64_t length;
  uint64_t payload_sum;
  uint64_t header_sum;  // over every field above
};

// A record file: this header, then `length` bytes of record.
constexpr uint64_t kRecordMagic = 0x54505553594e5243ULL;  // "TPUSYNRC"
struct RecordHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t length;
  uint64_t fingerprint;
  uint64_t key_hi;
  uint64_t key_lo;
  uint64_t record_sum;
  uint64_t header_sum;  // over every field above
};

std::string Hex16(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

uint64_t NowNs() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

Status MakeDir(const std::string& path) {
  if (::mkdir(path.c_str(), 0700) == 0 || errno == EEXIST) return Status::Ok();
  return ErrnoStatus(errno, "create directory " + path);
}

std::vector<std::string> ListDir(const std::string& path) {
  std::vector<std::string> names;
  DIR* d = ::opendir(path.c_str());
  if (d == nullptr) return names;
  while (dirent* e = ::readdir(d)) {  // NOLINT(concurrency-mt-unsafe): one DIR per call
    if (e->d_name[0] != '.') names.emplace_back(e->d_name);
  }
  ::closedir(d);
  return names;
}

int64_t SecondsOf(const timespec& t) { return t.tv_sec; }

// A filesystem as df counts it for the ones writing to it: the bytes in use and the bytes they
// can use at most (in use plus available). Blocks reserved for root, or withheld by the
// storage below (this project's VMs show a 252 GB disk with 92 GB usable), count as neither;
// counted as used, they made a half-empty filesystem look 85 % full to the evictor.
struct FsUse {
  uint64_t used = 0, size = 0;
};

bool UsageOf(const std::string& path, FsUse* out) {
  struct statvfs vfs{};
  if (::statvfs(path.c_str(), &vfs) != 0) return false;
  out->used = (uint64_t{vfs.f_blocks} - vfs.f_bfree) * vfs.f_frsize;
  out->size = out->used + uint64_t{vfs.f_bavail} * vfs.f_frsize;
  return true;
}

// Writes `iov` to a new temporary file and publishes it at `path` by rename: readers see a
// whole file or none. close() reports a network filesystem's deferred write errors (NFS, FUSE
// flush). The temporary file is gone whatever happens; ENOSPC and EDQUOT are kResourceExhausted.
Status Publish(const std::string& tmp, const std::string& path, struct iovec* iov, int iovcnt, int extra_flags) {
  Status st = Status::Ok();
  {
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | extra_flags, 0600));
    if (!fd.valid()) return ErrnoStatus(errno, "create " + tmp);
    st = PwritevFull(fd.get(), iov, iovcnt, 0, tmp);
    if (st.ok() && ::close(fd.release()) != 0) st = ErrnoStatus(errno, "close " + tmp);
  }
  if (st.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) st = ErrnoStatus(errno, "publish " + path);
  if (!st.ok()) ::unlink(tmp.c_str());
  return st;
}

// Unlinks `path` unless another host has replaced it since inode `ino` was read there.
bool UnlinkIfSame(const std::string& path, uint64_t ino) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0 && st.st_ino == ino && ::unlink(path.c_str()) == 0;
}

// dir/name, and dir/name + suffix, built in one string (the evictor builds many).
std::string Join(const std::string& dir, const std::string& name, const std::string& suffix = "") {
  std::string out;
  out.reserve(dir.size() + 1 + name.size() + suffix.size());
  out.append(dir).append("/").append(name).append(suffix);
  return out;
}

}  // namespace

Result<std::unique_ptr<SharedTier>> SharedTier::Open(const SharedTierOptions& o) {
  if (o.block_bytes == 0 || o.block_bytes % kPageBytes != 0) {
    return InvalidArgument("shared tier block_bytes " + std::to_string(o.block_bytes) + " is not a multiple of 4096");
  }
  if (!(o.low_watermark > 0 && o.low_watermark < o.high_watermark && o.high_watermark <= 1)) {
    return InvalidArgument("shared tier watermarks must satisfy 0 < low < high <= 1");
  }
  if (o.dir.empty()) return InvalidArgument("shared tier directory is empty");
  std::unique_ptr<SharedTier> t(new SharedTier());
  t->options_ = o;
  t->block_bytes_ = o.block_bytes;

  // The fingerprint covers every input that changes a block's bytes; the inputs are kept beside
  // the blocks so a person (or a colliding fingerprint) can tell what a directory holds.
  const std::string layout =
      "tpusync shared tier 1\nblock_bytes " + std::to_string(o.block_bytes) + "\nlayout " + o.layout + "\n";
  const uint64_t fingerprint = Checksum(layout.data(), layout.size());
  t->fingerprint_ = fingerprint;
  std::error_code ec;
  std::filesystem::create_directories(o.dir, ec);
  if (ec) return Status(StatusCode::kIoError, "create shared tier directory " + o.dir + ": " + ec.message());
  t->top_ = o.dir + "/" + kTop;
  t->root_ = t->top_ + "/" + Hex16(fingerprint);
  for (const std::string& d : {t->top_, t->root_, t->root_ + "/tmp", t->root_ + "/pins", t->root_ + "/records"}) {
    TPUSYNC_RETURN_IF_ERROR(MakeDir(d));
  }

  std::random_device rd;
  t->instance_ = Hex16((uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(::getpid()));

  const std::string layout_path = t->root_ + "/layout";
  if (std::ifstream in(layout_path); in) {
    std::stringstream got;
    got << in.rdbuf();
    if (got.str() != layout) {
      return FailedPrecondition("shared tier " + t->root_ + " holds another layout (" + got.str() +
                                "): fingerprint collision; use another directory");
    }
  } else {
    const std::string tmp = t->root_ + "/tmp/layout." + t->instance_;
    if (!(std::ofstream(tmp) << layout) || ::rename(tmp.c_str(), layout_path.c_str()) != 0) {
      return ErrnoStatus(errno, "publish " + layout_path);
    }
  }

  // Direct I/O only where an aligned write through O_DIRECT works (tmpfs and many FUSE
  // filesystems refuse the flag at open, some only at the first write).
  if (o.direct_io) {
    const std::string probe = t->root_ + "/tmp/probe." + t->instance_;
    UniqueFd fd(::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0600));
    if (fd.valid()) {
      AlignedBuffer b(kPageBytes);
      std::memset(b.data(), 0, kPageBytes);
      t->direct_io_ = ::pwrite(fd.get(), b.data(), kPageBytes, 0) == static_cast<ssize_t>(kPageBytes);
    }
    ::unlink(probe.c_str());
  }

  FsUse fs;
  if (!UsageOf(t->top_, &fs)) return ErrnoStatus(errno, "statvfs " + t->top_);
  t->capacity_ = o.capacity_bytes != 0 ? std::min(o.capacity_bytes, fs.size) : fs.size;
  t->stats_.capacity_bytes = t->capacity_;
  t->stats_.direct_io = t->direct_io_;
  TPUSYNC_RETURN_IF_ERROR(t->EvictOnce().status());  // also measures what the tier holds
  if (o.run_evictor) {
    t->evictor_ = std::jthread([p = t.get()](const std::stop_token& st) { p->EvictLoop(st); });
  }
  return t;
}

SharedTier::~SharedTier() {
  evictor_ = {};  // joins
  for (const auto& [key, n] : pins_) ::unlink(PinPath(key).c_str());
}

std::string SharedTier::BlockPath(const BlockKey& key) const {
  const std::string hex = key.ToHex();
  return root_ + "/" + hex.substr(0, 2) + "/" + hex;
}

std::string SharedTier::PinPath(const BlockKey& key) const { return root_ + "/pins/" + key.ToHex() + "." + instance_; }

std::string SharedTier::RecordPath(const BlockKey& key) const {
  const std::string hex = key.ToHex();
  return root_ + "/records/" + hex.substr(0, 2) + "/" + hex;
}

bool SharedTier::Exists(const BlockKey& key) {
  struct stat st{};
  return ::stat(BlockPath(key).c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool SharedTier::Holds(const BlockKey& key) {
  const UniqueFd fd(::open(BlockPath(key).c_str(), O_RDONLY | O_CLOEXEC));
  return fd.valid();
}

Status SharedTier::Refuse(uint64_t file_bytes) {
  Count(&SharedTierStats::refused_full);
  return ResourceExhausted("shared tier " + root_ + " cannot hold " + std::to_string(file_bytes) + " more bytes");
}

Status SharedTier::Write(const BlockKey& key, const std::byte* src, uint64_t length) {
  if (length == 0 || length > block_bytes_) {
    return InvalidArgument("shared write: length " + std::to_string(length) + " outside 1.." +
                           std::to_string(block_bytes_));
  }
  if (Exists(key)) {
    Count(&SharedTierStats::write_dedup);
    return Status::Ok();
  }
  const uint64_t start = NowNs();
  const uint64_t payload = AlignUp(length, kPageBytes);
  const uint64_t file_bytes = kHeaderBytes + payload;
  // At capacity, evict now rather than refuse until the next pass; a pass finds nothing to
  // delete only when every file is pinned.
  for (int attempt = 0;; ++attempt) {
    uint64_t used = 0;
    {
      std::lock_guard lock(mu_);
      used = stats_.used_bytes;
    }
    if (used + file_bytes <= capacity_) break;
    if (attempt == 1) {
      Count(&SharedTierStats::refused_full);
      return ResourceExhausted("shared tier " + root_ + " is at its capacity of " + std::to_string(capacity_) +
                               " bytes, held by pinned blocks");
    }
    TPUSYNC_RETURN_IF_ERROR(EvictOnce().status());
  }
  struct statvfs vfs{};
  if (::statvfs(root_.c_str(), &vfs) == 0 && uint64_t{vfs.f_bavail} * vfs.f_frsize < file_bytes) {
    return Refuse(file_bytes);
  }
  const std::string path = BlockPath(key);
  TPUSYNC_RETURN_IF_ERROR(MakeDir(path.substr(0, path.rfind('/'))));
  const std::string tmp = root_ + "/tmp/" + key.ToHex() + "." + instance_ + "." + std::to_string(++temp_seq_);

  AlignedBuffer hdr(kHeaderBytes);
  std::memset(hdr.data(), 0, kHeaderBytes);
  auto* h = reinterpret_cast<FileHeader*>(hdr.data());
  *h = FileHeader{kMagic, kVersion, 0, block_bytes_, fingerprint_, key.hi, key.lo, length, Checksum(src, length), 0};
  h->header_sum = HeaderSum(*h);

  struct iovec iov[2] = {{hdr.data(), kHeaderBytes}, {const_cast<std::byte*>(src), payload}};
  if (Status st = Publish(tmp, path, iov, 2, direct_io_ ? O_DIRECT : 0); !st.ok()) {
    if (st.code() == StatusCode::kResourceExhausted) return Refuse(file_bytes);  // ENOSPC, EDQUOT
    Count(&SharedTierStats::write_errors);
    return st;
  }
  std::lock_guard lock(mu_);
  ++stats_.writes;
  stats_.bytes_written += length;
  stats_.used_bytes += file_bytes;
  stats_.write_ns += NowNs() - start;
  return Status::Ok();
}

// Removes a damaged file unless another host has replaced it with a new one since it was read.
void SharedTier::Remove(const BlockKey& key, const std::string& path, uint64_t ino, const std::string& why) {
  if (UnlinkIfSame(path, ino)) {
    ::unlink(RecordPath(key).c_str());
    Changed(key);
  }
  Damaged(why);
}

void SharedTier::Damaged(const std::string& why) {
  uint64_t n = 0;
  {
    std::lock_guard lock(mu_);
    n = ++stats_.corruptions;
  }
  if ((n & (n - 1)) == 0) {  // logged at the 1st, 2nd, 4th, ... damaged file
    Log(LogLevel::kWarning, "shared", std::to_string(n) + " damaged files removed from the shared tier so far; latest: " + why);
  }
}

bool SharedTier::PinnedHere(const BlockKey& key) const {
  std::lock_guard lock(mu_);
  return pins_.count(key) != 0;
}

Result<uint64_t> SharedTier::Read(const BlockKey& key, std::byte* dst, uint64_t capacity) {
  const uint64_t start = NowNs();
  const std::string path = BlockPath(key);
  UniqueFd fd;
  int err = 0;
  auto open_block = [&] {
    fd = UniqueFd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | (direct_io_ ? O_DIRECT : 0)));
    err = fd.valid() ? 0 : errno;
  };
  open_block();
  // Pinned here and absent: an evictor renamed it aside before it read our marker, and puts it
  // back once it has. Wait for that rather than report a pinned block missing.
  for (auto wait = std::chrono::microseconds(200), waited = std::chrono::microseconds(0);
       err == ENOENT && waited < kPinnedReadWait && PinnedHere(key); waited += wait, wait *= 2) {
    std::this_thread::sleep_for(wait);
    open_block();
  }
  if (!fd.valid()) {
    Count(err == ENOENT ? &SharedTierStats::misses : &SharedTierStats::read_errors);
    if (err == ENOENT) return NotFound("shared tier: block " + key.ToHex() + " is absent");
    return ErrnoStatus(err, "open " + path);
  }
  struct stat st{};
  if (::fstat(fd.get(), &st) != 0) {
    Count(&SharedTierStats::read_errors);
    return ErrnoStatus(errno, "stat " + path);
  }
  auto damaged = [&](const std::string& what) -> Status {
    Remove(key, path, st.st_ino, path + ": " + what);
    return DataLoss("shared tier file " + path + " " + what);
  };
  // One read of the header and the payload the file's size implies; the header then says
  // whether that size was right.
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes < kHeaderBytes + kPageBytes || file_bytes % kPageBytes != 0 ||
      file_bytes > kHeaderBytes + block_bytes_) {
    return damaged("has the wrong size");
  }
  if (file_bytes - kHeaderBytes > capacity) {
    return InvalidArgument("shared read: block " + key.ToHex() + " needs " + std::to_string(file_bytes - kHeaderBytes) +
                           " bytes, the buffer holds " + std::to_string(capacity));
  }
  AlignedBuffer hdr(kHeaderBytes);
  struct iovec iov[2] = {{hdr.data(), kHeaderBytes}, {dst, file_bytes - kHeaderBytes}};
  if (Status s = PreadvFull(fd.get(), iov, 2, 0, path); !s.ok()) {
    if (s.code() == StatusCode::kDataLoss) return damaged("is truncated");
    Count(&SharedTierStats::read_errors);
    return s;
  }
  const auto* h = reinterpret_cast<const FileHeader*>(hdr.data());
  if (h->magic != kMagic || h->version != kVersion || h->header_sum != HeaderSum(*h) || h->block_bytes != block_bytes_ ||
      h->fingerprint != fingerprint_ || h->length == 0 || h->length > block_bytes_) {
    return damaged("has a damaged header");
  }
  if (h->key_hi != key.hi || h->key_lo != key.lo) return damaged("names another block");
  const uint64_t length = h->length, sum = h->payload_sum;
  if (file_bytes != kHeaderBytes + AlignUp(length, kPageBytes)) return damaged("has the wrong size");
  if (Checksum(dst, length) != sum) return damaged("fails its payload checksum");
  // The access time orders the pool-wide LRU; set explicitly, since noatime and relatime
  // mounts (Lustre's default among them) do not, and at most once a minute per file: a
  // metadata write per hit would cost more than the order is worth.
  const int64_t now_s = std::chrono::duration_cast<std::chrono::seconds>(
                            std::chrono::system_clock::now().time_since_epoch()).count();
  if (now_s - st.st_atim.tv_sec >= kAtimeGranularitySeconds) {
    const timespec times[2] = {{0, UTIME_NOW}, {0, UTIME_OMIT}};
    (void)::futimens(fd.get(), times);
  }
  std::lock_guard lock(mu_);
  ++stats_.hits;
  stats_.bytes_read += length;
  stats_.read_ns += NowNs() - start;
  return length;
}

Status SharedTier::Describe(const BlockKey& key, std::span<const std::byte> record) {
  if (record.empty() || record.size() > kMaxRecordBytes) {
    return InvalidArgument("shared describe: a record of " + std::to_string(record.size()) + " bytes is outside 1.." +
                           std::to_string(kMaxRecordBytes));
  }
  const std::string path = RecordPath(key);
  struct stat st{};
  if (::stat(path.c_str(), &st) == 0) return Status::Ok();
  TPUSYNC_RETURN_IF_ERROR(MakeDir(path.substr(0, path.rfind('/'))));
  RecordHeader h{kRecordMagic, kVersion, static_cast<uint32_t>(record.size()), fingerprint_, key.hi, key.lo,
                 Checksum(record.data(), record.size()), 0};
  h.header_sum = HeaderSum(h);
  const std::string tmp = root_ + "/tmp/" + key.ToHex() + ".record." + instance_ + "." + std::to_string(++temp_seq_);
  struct iovec iov[2] = {{&h, sizeof(h)}, {const_cast<std::byte*>(record.data()), record.size()}};
  return Publish(tmp, path, iov, 2, 0);
}

std::string SharedTier::Record(const BlockKey& key) {
  const std::string path = RecordPath(key);
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  struct stat st{};
  if (!fd.valid() || ::fstat(fd.get(), &st) != 0) return {};
  RecordHeader h{};
  std::string record;
  const auto size = static_cast<uint64_t>(st.st_size);
  bool whole = size > sizeof(h) && size - sizeof(h) <= kMaxRecordBytes;
  if (whole) {
    record.resize(size - sizeof(h));
    struct iovec iov[2] = {{&h, sizeof(h)}, {record.data(), record.size()}};
    whole = PreadvFull(fd.get(), iov, 2, 0, path).ok() && h.magic == kRecordMagic && h.version == kVersion &&
            h.header_sum == HeaderSum(h) && h.fingerprint == fingerprint_ && h.key_hi == key.hi && h.key_lo == key.lo &&
            h.length == record.size() && Checksum(record.data(), record.size()) == h.record_sum;
  }
  if (!whole) {  // damaged: gone, so that a host that knows the block can describe it again
    UnlinkIfSame(path, st.st_ino);
    Damaged(path + ": a damaged record");
    return {};
  }
  return record;
}

std::vector<BlockKey> SharedTier::Catalog(size_t max) const {
  std::lock_guard lock(mu_);
  return {catalog_.begin(), catalog_.begin() + static_cast<ptrdiff_t>(std::min(max, catalog_.size()))};
}

Status SharedTier::Pin(const BlockKey& key) {
  std::lock_guard lock(mu_);
  if (pins_[key]++ == 0) {
    const std::string marker = PinPath(key);
    UniqueFd fd(::open(marker.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600));
    if (!fd.valid()) {
      pins_.erase(key);
      return ErrnoStatus(errno, "create pin " + marker);
    }
    // The marker exists before the block is looked at: see the header.
    if (!Exists(key)) {
      ::unlink(marker.c_str());
      pins_.erase(key);
      return NotFound("shared tier: block " + key.ToHex() + " is absent");
    }
  }
  return Status::Ok();
}

void SharedTier::Release(const BlockKey& key) {
  std::lock_guard lock(mu_);
  auto it = pins_.find(key);
  if (it == pins_.end()) return;
  if (--it->second == 0) {
    ::unlink(PinPath(key).c_str());
    pins_.erase(it);
  }
}

void SharedTier::RefreshPins() {
  std::lock_guard lock(mu_);
  for (const auto& [key, n] : pins_) (void)::utimensat(AT_FDCWD, PinPath(key).c_str(), nullptr, 0);
}

Result<uint64_t> SharedTier::EvictOnce() {
  struct File {
    int64_t atime;
    uint64_t bytes;
    std::string layout_dir, name;  // name: <kk>/<key>
  };
  std::lock_guard scan(scan_mu_);
  const auto now = std::chrono::system_clock::now();
  const int64_t now_s = std::chrono::duration_cast<std::chrono::seconds>(now.time_since_epoch()).count();
  const int64_t ttl_s = std::max<int64_t>(1, std::chrono::duration_cast<std::chrono::seconds>(options_.pin_ttl).count());
  std::vector<File> files;
  uint64_t used = 0, stale = 0;
  // Records whose block never came or left without them (a host died in between): one of the
  // 256 record directories of each layout a pass, so a pass costs a stat per 256th record.
  const std::string orphans = Hex16(orphan_sweep_++ % 256).substr(14);
  for (const std::string& layout : ListDir(top_)) {
    const std::string dir = Join(top_, layout);
    for (const std::string& sub : ListDir(dir)) {
      struct stat st{};
      const std::string path = Join(dir, sub);
      if (sub == "tmp") {  // a writer or evictor that died mid-way left these
        for (const std::string& name : ListDir(path)) {
          const std::string p = Join(path, name);
          if (::stat(p.c_str(), &st) == 0 && now_s - SecondsOf(st.st_mtim) > ttl_s && ::unlink(p.c_str()) == 0) ++stale;
        }
        continue;
      }
      if (sub.size() != 2) continue;  // layout, pins, records
      for (const std::string& name : ListDir(path)) {
        if (::stat(Join(path, name).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
        files.push_back({SecondsOf(st.st_atim) * 1000000000 + st.st_atim.tv_nsec, static_cast<uint64_t>(st.st_size),
                         dir, Join(sub, name)});
        used += static_cast<uint64_t>(st.st_size);
      }
    }
    const std::string records = Join(dir, "records/" + orphans);
    for (const std::string& name : ListDir(records)) {
      struct stat st{};
      const std::string p = Join(records, name);
      if (::stat(Join(dir, Join(orphans, name)).c_str(), &st) == 0 || ::stat(p.c_str(), &st) != 0) continue;
      if (now_s - SecondsOf(st.st_mtim) > ttl_s && ::unlink(p.c_str()) == 0) ++stale;
    }
  }
  // Over the tier's capacity, or over the filesystem's watermark when others' files fill it.
  uint64_t excess = 0;
  if (used > options_.high_watermark * capacity_) excess = used - static_cast<uint64_t>(options_.low_watermark * capacity_);
  if (FsUse fs; UsageOf(top_, &fs) && fs.size > 0) {
    const auto fs_used = static_cast<double>(fs.used), total = static_cast<double>(fs.size);
    if (fs_used > options_.high_watermark * total) {
      excess = std::max(excess, static_cast<uint64_t>(fs_used - options_.low_watermark * total));
    }
  }
  // Rounds of victims, least recently read first: renamed aside so no reader finds them, then
  // the pins read (after every rename: a pin made before a rename is seen), pinned victims put
  // back and the rest deleted, until enough is freed.
  std::sort(files.begin(), files.end(), [](const File& a, const File& b) { return a.atime < b.atime; });
  uint64_t freed = 0, evicted = 0, restored = 0, spared = 0;
  // "<layout dir>/<key>" of every block with a live pin marker in `layout_dir`; markers older
  // than pin_ttl are a dead host's, removed.
  auto read_pinned = [&](const std::string& layout_dir, std::unordered_set<std::string>& out) {
    const std::string pins = Join(layout_dir, "pins");
    for (const std::string& name : ListDir(pins)) {
      struct stat st{};
      const std::string p = Join(pins, name);
      if (::stat(p.c_str(), &st) != 0) continue;
      if (now_s - SecondsOf(st.st_mtim) > ttl_s) {
        ::unlink(p.c_str());
        continue;
      }
      out.insert(Join(layout_dir, name.substr(0, name.find('.'))));
    }
  };
  std::unordered_set<std::string> pinned_at_start, layouts;
  if (excess > 0) {
    for (const File& f : files) {
      if (layouts.insert(f.layout_dir).second) read_pinned(f.layout_dir, pinned_at_start);
    }
  }
  std::unordered_set<BlockKey, BlockKeyHash> gone;  // this layout's blocks evicted here
  size_t next = 0;
  while (freed < excess && next < files.size()) {
    std::vector<std::pair<const File*, std::string>> aside;
    for (uint64_t round = freed; round < excess && next < files.size(); ++next) {
      const File& f = files[next];
      if (pinned_at_start.count(Join(f.layout_dir, f.name.substr(3))) != 0) {  // never taken aside
        ++spared;
        continue;
      }
      const std::string moved = Join(f.layout_dir + "/tmp", f.name.substr(3), ".evict." + instance_);
      if (::rename(Join(f.layout_dir, f.name).c_str(), moved.c_str()) != 0) continue;  // another evictor's
      aside.emplace_back(&f, moved);
      round += f.bytes;
    }
    std::unordered_set<std::string> pinned, read_pins;
    for (const auto& [f, moved] : aside) {
      if (read_pins.insert(f->layout_dir).second) read_pinned(f->layout_dir, pinned);
    }
    for (const auto& [f, moved] : aside) {
      if (pinned.count(Join(f->layout_dir, f->name.substr(3))) != 0) {
        if (::rename(moved.c_str(), Join(f->layout_dir, f->name).c_str()) == 0) ++restored;
      } else if (::unlink(moved.c_str()) == 0) {
        ::unlink(Join(f->layout_dir, "records/" + f->name).c_str());
        ++evicted;
        freed += f->bytes;
        BlockKey key;
        if (f->layout_dir == root_ && KeyFromHex(f->name.substr(3), &key)) gone.insert(key);
      }
    }
  }
  // This layout's catalog, most recently read first, and what changed since the last pass.
  std::vector<BlockKey> catalog;
  for (auto it = files.rbegin(); it != files.rend(); ++it) {
    BlockKey key;
    if (it->layout_dir == root_ && KeyFromHex(it->name.substr(3), &key) && gone.count(key) == 0) catalog.push_back(key);
  }
  std::vector<BlockKey> changed(gone.begin(), gone.end());
  {
    std::lock_guard lock(mu_);
    if (scanned_) {
      const std::unordered_set<BlockKey, BlockKeyHash> before(catalog_.begin(), catalog_.end());
      const std::unordered_set<BlockKey, BlockKeyHash> after(catalog.begin(), catalog.end());
      for (const BlockKey& k : catalog) {
        if (before.count(k) == 0) changed.push_back(k);  // published since
      }
      for (const BlockKey& k : catalog_) {
        if (after.count(k) == 0 && gone.count(k) == 0) changed.push_back(k);  // removed elsewhere
      }
    }
    scanned_ = true;
    catalog_ = std::move(catalog);
    stats_.blocks = catalog_.size();
    stats_.used_bytes = used - freed;
    stats_.evictions += evicted;
    stats_.evicted_bytes += freed;
    stats_.pins_restored += restored;
    stats_.pins_spared += spared;
    stats_.stale_files_removed += stale;
  }
  for (const BlockKey& k : changed) Changed(k);
  return evicted;
}

void SharedTier::EvictLoop(const std::stop_token& stop) {
  std::mutex m;
  std::condition_variable_any cv;
  auto last_refresh = std::chrono::steady_clock::now();
  std::unique_lock lock(m);
  for (;;) {
    cv.wait_for(lock, stop, options_.evict_interval, [] { return false; });
    if (stop.stop_requested()) return;
    if (Result<uint64_t> r = EvictOnce(); !r.ok()) Log(LogLevel::kWarning, "shared", "eviction pass: " + r.status().ToString());
    if (std::chrono::steady_clock::now() - last_refresh > options_.pin_ttl / 4) {
      RefreshPins();
      last_refresh = std::chrono::steady_clock::now();
    }
  }
}

SharedTierStats SharedTier::Stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

}  // namespace tpusync
