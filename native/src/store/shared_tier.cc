#include "store/shared_tier.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>

#include "base/log.h"
#include "base/posix_io.h"
#include "store/shared_files.h"
#include "store/shared_tier_impl.h"

namespace tpusync {
namespace {

constexpr int64_t kAtimeGranularitySeconds = 60;

uint64_t NowNs() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

// Writes `iov` to a new temporary file and publishes it at `name` below `dest` by rename:
// readers see a whole file or none. close() reports a network filesystem's deferred write
// errors (NFS, FUSE flush). The temporary file is gone whatever happens; ENOSPC and EDQUOT are
// kResourceExhausted.
Status Publish(const shared::TierDir& tmp_dir, const std::string& tmp, const shared::TierDir& dest,
               const std::string& name, struct iovec* iov, int iovcnt, int extra_flags) {
  Status st = Status::Ok();
  {
    UniqueFd fd = tmp_dir.Open(tmp, O_WRONLY | O_CREAT | O_EXCL | extra_flags, 0600);
    if (!fd.valid()) return ErrnoStatus(errno, "create " + tmp_dir.path() + "/" + tmp);
    st = PwritevFull(fd.get(), iov, iovcnt, 0, tmp);
    if (st.ok() && ::close(fd.release()) != 0) st = ErrnoStatus(errno, "close " + tmp_dir.path() + "/" + tmp);
  }
  if (st.ok() && !tmp_dir.RenameTo(tmp, dest, name)) st = ErrnoStatus(errno, "publish " + dest.path() + "/" + name);
  if (!st.ok()) tmp_dir.Unlink(tmp);
  return st;
}

}  // namespace

SharedTier::SharedTier() = default;

Result<std::unique_ptr<SharedTier>> SharedTier::Open(const SharedTierOptions& o) {
  if (o.block_bytes == 0 || o.block_bytes % kPageBytes != 0) {
    return InvalidArgument("shared tier block_bytes " + std::to_string(o.block_bytes) + " is not a multiple of 4096");
  }
  if (!(o.low_watermark > 0 && o.low_watermark < o.high_watermark && o.high_watermark <= 1)) {
    return InvalidArgument("shared tier watermarks must satisfy 0 < low < high <= 1");
  }
  if (o.dir.empty()) return InvalidArgument("shared tier directory is empty");
  // Everything that changes a block's bytes; kept beside the blocks, as text, for people.
  const std::string layout =
      "tpusync shared tier 2\nblock_bytes " + std::to_string(o.block_bytes) + "\nlayout " + o.layout + "\n";
  TPUSYNC_ASSIGN_OR_RETURN(shared::SharedKeys keys, shared::SharedKeys::Derive(std::as_bytes(std::span(o.secret)), layout));
  // The configured directory must exist: a mount that is missing would otherwise become a
  // directory on this host's boot disk, a "shared" tier no other host sees.
  TPUSYNC_ASSIGN_OR_RETURN(shared::TierDir mount, shared::TierDir::OpenPath(o.dir));
  TPUSYNC_ASSIGN_OR_RETURN(shared::TierDir top, mount.Sub(shared::kTop, true));
  TPUSYNC_ASSIGN_OR_RETURN(shared::TierDir pool, top.Sub(keys.pool_dir(), true));
  TPUSYNC_ASSIGN_OR_RETURN(shared::TierDir root, pool.Sub(Hex16(keys.fingerprint()), true));
  for (const char* sub : {"pins", "records"}) TPUSYNC_RETURN_IF_ERROR(root.Sub(sub, true).status());
  TPUSYNC_ASSIGN_OR_RETURN(shared::TierDir tmp, root.Sub("tmp", true));

  std::unique_ptr<SharedTier> t(new SharedTier());
  t->options_ = o;
  t->block_bytes_ = o.block_bytes;
  t->root_ = root.path();
  std::array<std::byte, 8> id{};
  TPUSYNC_RETURN_IF_ERROR(RandomBytes(id));
  uint64_t instance = 0;
  std::memcpy(&instance, id.data(), sizeof instance);
  t->instance_ = Hex16(instance);
  t->files_ = std::make_unique<Files>(Files{std::move(keys), std::move(pool), std::move(root), std::move(tmp), {}});
  const Files& f = *t->files_;

  // The layout's text, for people: never read back (a file anyone may have written).
  struct stat st{};
  if (!f.root.Stat("layout", &st) || !S_ISREG(st.st_mode) || static_cast<size_t>(st.st_size) != layout.size()) {
    f.root.Unlink("layout");
    struct iovec iov{const_cast<char*>(layout.data()), layout.size()};
    TPUSYNC_RETURN_IF_ERROR(Publish(f.tmp, "layout." + t->instance_, f.root, "layout", &iov, 1, 0));
  }

  // Direct I/O only where an aligned write through O_DIRECT works (tmpfs and many FUSE
  // filesystems refuse the flag at open, some only at the first write).
  if (o.direct_io) {
    const std::string probe = "probe." + t->instance_;
    UniqueFd fd = f.tmp.Open(probe, O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0600);
    if (fd.valid()) {
      AlignedBuffer b(kPageBytes);
      std::memset(b.data(), 0, kPageBytes);
      t->direct_io_ = ::pwrite(fd.get(), b.data(), kPageBytes, 0) == static_cast<ssize_t>(kPageBytes);
    }
    f.tmp.Unlink(probe);
  }

  FsUse fs;
  if (!UsageOf(f.pool.fd(), &fs)) return ErrnoStatus(errno, "statvfs " + f.pool.path());
  t->capacity_ = o.capacity_bytes != 0 ? std::min(o.capacity_bytes, fs.size) : fs.size;
  t->stats_.capacity_bytes = t->capacity_;
  t->stats_.direct_io = t->direct_io_;
  TPUSYNC_RETURN_IF_ERROR(t->EvictOnce().status());  // also measures what the tier holds
  if (o.run_evictor) {
    t->evictor_ = std::jthread([p = t.get()](const std::stop_token& stop) { p->EvictLoop(stop); });
  }
  return t;
}

SharedTier::~SharedTier() {
  evictor_ = {};  // joins
  for (const auto& [key, n] : pins_) files_->root.Unlink(PinName(key));
}

std::string SharedTier::PinName(const BlockKey& key) const { return "pins/" + key.ToHex() + "." + instance_; }

bool SharedTier::Verified(const BlockKey& key, const FileId& id) const {
  std::lock_guard lock(mu_);
  auto it = files_->verified.find(key);
  return it != files_->verified.end() && it->second == id;
}

bool SharedTier::HeaderVerifies(const BlockKey& key, int fd, const FileId& id) {
  if (Verified(key, id)) return true;
  if (!shared::PlausibleBlockSize(id.size, block_bytes_)) return false;
  AlignedBuffer page(shared::kHeaderBytes);  // aligned: `fd` may be open with O_DIRECT
  struct iovec iov{page.data(), shared::kHeaderBytes};
  if (!PreadvFull(fd, &iov, 1, 0, root_).ok()) return false;
  const auto* h = reinterpret_cast<const shared::BlockHeader*>(page.data());
  if (!shared::HeaderProblem(files_->keys, block_bytes_, key, *h, id.size).empty()) return false;
  std::lock_guard lock(mu_);
  files_->Remember(key, id);
  return true;
}

bool SharedTier::Exists(const BlockKey& key) {
  const UniqueFd fd = files_->root.OpenToCheck(shared::BlockName(key));
  struct stat st{};
  if (!fd.valid() || ::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  return HeaderVerifies(key, fd.get(), IdOf<FileId>(st));
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
  if (Exists(key)) {  // a file that does not verify is no block: written over below
    Count(&SharedTierStats::write_dedup);
    return Status::Ok();
  }
  const uint64_t start = NowNs();
  const uint64_t payload = AlignUp(length, kPageBytes);
  const uint64_t file_bytes = shared::kHeaderBytes + payload;
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
  const Files& f = *files_;
  struct statvfs vfs{};
  if (::fstatvfs(f.root.fd(), &vfs) == 0 && uint64_t{vfs.f_bavail} * vfs.f_frsize < file_bytes) {
    return Refuse(file_bytes);
  }
  const std::string name = shared::BlockName(key);
  if (Status st = f.root.Sub(name.substr(0, 2), true).status(); !st.ok()) {
    Count(&SharedTierStats::write_errors);
    return st;
  }
  const std::string tmp = key.ToHex() + "." + instance_ + "." + std::to_string(++temp_seq_);

  AlignedBuffer hdr(shared::kHeaderBytes);
  std::memset(hdr.data(), 0, shared::kHeaderBytes);
  auto* h = reinterpret_cast<shared::BlockHeader*>(hdr.data());
  TPUSYNC_RETURN_IF_ERROR(shared::SealBlock(f.keys, block_bytes_, key, src, length, h));

  struct iovec iov[2] = {{hdr.data(), shared::kHeaderBytes}, {const_cast<std::byte*>(src), payload}};
  if (Status st = Publish(f.tmp, tmp, f.root, name, iov, 2, direct_io_ ? O_DIRECT : 0); !st.ok()) {
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
void SharedTier::Remove(const BlockKey& key, uint64_t ino, const std::string& why) {
  const Files& f = *files_;
  struct stat st{};
  const std::string name = shared::BlockName(key);
  if (f.root.Stat(name, &st) && st.st_ino == ino && f.root.Unlink(name)) {
    f.root.Unlink(shared::RecordName(key));
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
    Log(LogLevel::kWarning, "shared", std::to_string(n) + " damaged or unauthenticated files removed from the shared tier so far; latest: " + why);
  }
}

void SharedTier::Skipped(const std::string& path, const std::string& why) {
  constexpr size_t kMaxLogged = 4096;  // then counted only
  bool log = false;
  {
    std::lock_guard lock(mu_);
    ++stats_.skipped;
    log = skipped_.size() < kMaxLogged && skipped_.insert(path).second;
  }
  if (log) Log(LogLevel::kWarning, "shared", "skipping " + path + ": " + why);
}

bool SharedTier::PinnedHere(const BlockKey& key) const {
  std::lock_guard lock(mu_);
  return pins_.count(key) != 0;
}

Result<uint64_t> SharedTier::Read(const BlockKey& key, std::byte* dst, uint64_t capacity) {
  const uint64_t start = NowNs();
  const Files& f = *files_;
  const std::string name = shared::BlockName(key);
  const std::string path = root_ + "/" + name;
  UniqueFd fd;
  int err = 0;
  auto open_block = [&] {
    fd = f.root.Open(name, O_RDONLY | O_NONBLOCK | (direct_io_ ? O_DIRECT : 0));
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
    if (err == ENOENT) {
      Count(&SharedTierStats::misses);
      return NotFound("shared tier: block " + key.ToHex() + " is absent");
    }
    if (err == ELOOP || err == EXDEV || err == ENOTDIR) {  // a link on the way: never followed
      Skipped(path, "a link where a block or its directory belongs (never followed)");
      Count(&SharedTierStats::misses);
      return NotFound("shared tier: block " + key.ToHex() + " is absent (" + path + " is a link)");
    }
    Count(&SharedTierStats::read_errors);
    return ErrnoStatus(err, "open " + path);
  }
  struct stat st{};
  if (::fstat(fd.get(), &st) != 0) {
    Count(&SharedTierStats::read_errors);
    return ErrnoStatus(errno, "stat " + path);
  }
  if (!S_ISREG(st.st_mode)) {
    Skipped(path, "not a regular file");
    Count(&SharedTierStats::misses);
    return NotFound("shared tier: block " + key.ToHex() + " is absent (" + path + " is not a file)");
  }
  auto damaged = [&](const std::string& what) -> Status {
    Remove(key, st.st_ino, path + ": " + what);
    return DataLoss("shared tier file " + path + " " + what);
  };
  // One read of the header and the payload the file's size implies; the header then says
  // whether that size was right.
  const auto file_bytes = static_cast<uint64_t>(st.st_size);
  if (!shared::PlausibleBlockSize(file_bytes, block_bytes_)) return damaged("has the wrong size");
  if (file_bytes - shared::kHeaderBytes > capacity) {
    return InvalidArgument("shared read: block " + key.ToHex() + " needs " +
                           std::to_string(file_bytes - shared::kHeaderBytes) + " bytes, the buffer holds " +
                           std::to_string(capacity));
  }
  AlignedBuffer hdr(shared::kHeaderBytes);
  struct iovec iov[2] = {{hdr.data(), shared::kHeaderBytes}, {dst, file_bytes - shared::kHeaderBytes}};
  if (Status s = PreadvFull(fd.get(), iov, 2, 0, path); !s.ok()) {
    if (s.code() == StatusCode::kDataLoss) return damaged("is truncated");
    Count(&SharedTierStats::read_errors);
    return s;
  }
  const auto* h = reinterpret_cast<const shared::BlockHeader*>(hdr.data());
  if (std::string problem = shared::HeaderProblem(f.keys, block_bytes_, key, *h, file_bytes); !problem.empty()) {
    return damaged(problem);
  }
  if (!shared::PayloadVerifies(f.keys, *h, dst)) return damaged("fails its payload tag");
  const uint64_t length = h->length;
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
  files_->Remember(key, IdOf<FileId>(st));
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
  if (!Record(key).empty()) return Status::Ok();  // one that verifies; any other is replaced
  const Files& f = *files_;
  const std::string name = shared::RecordName(key);
  TPUSYNC_RETURN_IF_ERROR(f.root.Sub(name.substr(0, name.rfind('/')), true).status());
  shared::RecordHeader h{};
  TPUSYNC_RETURN_IF_ERROR(shared::SealRecord(f.keys, key, record, &h));
  const std::string tmp = key.ToHex() + ".record." + instance_ + "." + std::to_string(++temp_seq_);
  struct iovec iov[2] = {{&h, sizeof(h)}, {const_cast<std::byte*>(record.data()), record.size()}};
  return Publish(f.tmp, tmp, f.root, name, iov, 2, 0);
}

std::string SharedTier::Record(const BlockKey& key) {
  const Files& f = *files_;
  const std::string name = shared::RecordName(key);
  UniqueFd fd = f.root.Open(name, O_RDONLY | O_NONBLOCK);
  struct stat st{};
  if (!fd.valid() || ::fstat(fd.get(), &st) != 0) return {};
  if (!S_ISREG(st.st_mode)) {
    Skipped(root_ + "/" + name, "not a regular file");
    return {};
  }
  shared::RecordHeader h{};
  std::string record;
  const auto size = static_cast<uint64_t>(st.st_size);
  bool whole = size > sizeof(h) && size - sizeof(h) <= kMaxRecordBytes;
  if (whole) {
    record.resize(size - sizeof(h));
    struct iovec iov[2] = {{&h, sizeof(h)}, {record.data(), record.size()}};
    whole = PreadvFull(fd.get(), iov, 2, 0, name).ok() &&
            shared::RecordVerifies(f.keys, key, h, std::as_bytes(std::span(record)));
  }
  if (!whole) {  // damaged or forged: gone, so that a host that knows the block can describe it again
    struct stat now{};
    if (f.root.Stat(name, &now) && now.st_ino == st.st_ino) f.root.Unlink(name);
    Damaged(root_ + "/" + name + ": a damaged or unauthenticated record");
    return {};
  }
  return record;
}

std::vector<BlockKey> SharedTier::Catalog(size_t max) const {
  std::lock_guard lock(mu_);
  return {catalog_.begin(), catalog_.begin() + static_cast<ptrdiff_t>(std::min(max, catalog_.size()))};
}

Status SharedTier::Pin(const BlockKey& key) {
  std::lock_guard one_at_a_time(pin_mu_);
  {
    std::lock_guard lock(mu_);
    if (pins_[key]++ != 0) return Status::Ok();  // pinned here already, and found then
    const std::string marker = PinName(key);
    const UniqueFd fd = files_->root.Open(marker, O_WRONLY | O_CREAT | O_NONBLOCK, 0600);
    if (!fd.valid()) {
      const int err = errno;
      pins_.erase(key);
      return ErrnoStatus(err, "create pin " + root_ + "/" + marker);
    }
  }
  // The marker exists before the block is looked at: see the header.
  if (Exists(key)) return Status::Ok();
  Release(key);
  return NotFound("shared tier: block " + key.ToHex() + " is absent");
}

void SharedTier::Release(const BlockKey& key) {
  std::lock_guard lock(mu_);
  auto it = pins_.find(key);
  if (it == pins_.end()) return;
  if (--it->second == 0) {
    files_->root.Unlink(PinName(key));
    pins_.erase(it);
  }
}

void SharedTier::RefreshPins() {
  std::lock_guard lock(mu_);
  for (const auto& [key, n] : pins_) files_->root.SetTimes(PinName(key), nullptr);
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
