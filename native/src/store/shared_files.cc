#include "store/shared_files.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>

namespace tpusync::shared {
namespace {

constexpr uint64_t kBlockMagic = 0x32424e5953555054ULL;   // "TPUSYNB2", little-endian
constexpr uint64_t kRecordMagic = 0x32524e5953555054ULL;  // "TPUSYNR2"
constexpr uint32_t kVersion = 2;

// openat2 where the kernel has it (Linux 5.6): the whole name resolved beneath `dirfd` with no
// link anywhere on the way, in one call.
std::atomic<bool> g_no_openat2{false};

int OpenBeneath(int dirfd, const std::string& name, int flags, mode_t mode) {
  flags |= O_CLOEXEC | O_NOFOLLOW;
  if (!g_no_openat2.load(std::memory_order_relaxed)) {
    struct open_how how{};
    how.flags = static_cast<uint64_t>(flags);
    how.mode = (flags & O_CREAT) != 0 ? mode : 0;
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
    const long fd = ::syscall(SYS_openat2, dirfd, name.c_str(), &how, sizeof how);
    // ENOSYS: an older kernel; EPERM: a seccomp profile that predates the call.
    if (fd >= 0 || (errno != ENOSYS && errno != EPERM)) return static_cast<int>(fd);
    g_no_openat2.store(true, std::memory_order_relaxed);
  }
  // One component at a time, each a directory opened without following a link.
  UniqueFd held;
  int at = dirfd;
  size_t start = 0;
  for (size_t slash; (slash = name.find('/', start)) != std::string::npos; start = slash + 1) {
    const std::string part = name.substr(start, slash - start);
    if (part.empty() || part == "." || part == "..") {
      errno = EXDEV;  // what RESOLVE_BENEATH answers for a name that would leave the directory
      return -1;
    }
    held = UniqueFd(::openat(at, part.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!held.valid()) return -1;
    at = held.get();
  }
  const std::string last = name.substr(start);
  if (last == "..") {
    errno = EXDEV;
    return -1;
  }
  return ::openat(at, last.c_str(), flags, mode);
}

// The directory holding `name` (borrowed when that is `dir` itself) and its last component.
struct Parent {
  UniqueFd owned;
  int fd = -1;
  std::string last;
};

bool ParentOf(int dir, const std::string& name, Parent* p) {
  const size_t slash = name.rfind('/');
  if (slash == std::string::npos) {
    p->fd = dir;
    p->last = name;
  } else {
    p->owned = UniqueFd(OpenBeneath(dir, name.substr(0, slash), O_PATH | O_DIRECTORY, 0));
    if (!p->owned.valid()) return false;
    p->fd = p->owned.get();
    p->last = name.substr(slash + 1);
  }
  if (p->last.empty() || p->last == "." || p->last == "..") {
    errno = EINVAL;
    return false;
  }
  return true;
}

std::string Hex(std::span<const std::byte> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (std::byte b : bytes) {
    out += kDigits[static_cast<unsigned>(b) >> 4];
    out += kDigits[static_cast<unsigned>(b) & 15];
  }
  return out;
}

std::span<const std::byte> BytesOf(const void* p, size_t n) { return {static_cast<const std::byte*>(p), n}; }

GmacTag HeaderTag(const SharedKeys& keys, const BlockHeader& h) {
  return keys.header().Tag(std::to_array(h.iv), {BytesOf(&h, offsetof(BlockHeader, header_tag))});
}

GmacTag RecordTag(const SharedKeys& keys, const RecordHeader& h, std::span<const std::byte> record) {
  return keys.record().Tag(std::to_array(h.iv), {BytesOf(&h, offsetof(RecordHeader, tag)), record});
}

Status FreshIv(std::byte (&iv)[kGmacIvBytes]) { return RandomBytes(iv); }

}  // namespace

Result<TierDir> TierDir::OpenPath(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid() && errno == ENOENT) {
    return NotFound("shared tier directory " + path + " does not exist: mount the shared filesystem there (it is "
                    "never created: a missing mount would become a directory only this host sees)");
  }
  if (!fd.valid()) return ErrnoStatus(errno, "open shared tier directory " + path);
  return TierDir(std::move(fd), path);
}

Result<TierDir> TierDir::Sub(const std::string& name, bool create) const {
  const std::string path = path_ + "/" + name;
  if (create) {
    Parent p;
    if (!ParentOf(fd_.get(), name, &p)) return ErrnoStatus(errno, "open the parent of " + path);
    if (::mkdirat(p.fd, p.last.c_str(), 0700) != 0 && errno != EEXIST) return ErrnoStatus(errno, "create " + path);
  }
  UniqueFd fd(OpenBeneath(fd_.get(), name, O_RDONLY | O_DIRECTORY, 0));
  if (!fd.valid()) {
    if (errno == ELOOP || errno == ENOTDIR || errno == EXDEV) {
      return FailedPrecondition("shared tier entry " + path + " is not a directory (a link or a file there is "
                                "never followed; remove it)");
    }
    return ErrnoStatus(errno, "open " + path);
  }
  return TierDir(std::move(fd), path);
}

UniqueFd TierDir::Open(const std::string& name, int flags, mode_t mode) const {
  return UniqueFd(OpenBeneath(fd_.get(), name, flags, mode));
}

UniqueFd TierDir::OpenToCheck(const std::string& name) const {
  // O_NOATIME: a check is no use of the block; the access time orders the pool's LRU. Only a
  // file's owner may ask for it (EPERM otherwise: another host's uid wrote the file).
  UniqueFd fd = Open(name, O_RDONLY | O_NONBLOCK | O_NOATIME);
  if (!fd.valid() && errno == EPERM) fd = Open(name, O_RDONLY | O_NONBLOCK);
  return fd;
}

bool TierDir::Stat(const std::string& name, struct stat* st) const {
  Parent p;
  return ParentOf(fd_.get(), name, &p) && ::fstatat(p.fd, p.last.c_str(), st, AT_SYMLINK_NOFOLLOW) == 0;
}

bool TierDir::Unlink(const std::string& name) const {
  Parent p;
  return ParentOf(fd_.get(), name, &p) && ::unlinkat(p.fd, p.last.c_str(), 0) == 0;
}

bool TierDir::RenameTo(const std::string& from, const TierDir& dest, const std::string& to) const {
  Parent a, b;
  return ParentOf(fd_.get(), from, &a) && ParentOf(dest.fd(), to, &b) &&
         ::renameat(a.fd, a.last.c_str(), b.fd, b.last.c_str()) == 0;
}

bool TierDir::SetTimes(const std::string& name, const timespec times[2]) const {
  Parent p;
  return ParentOf(fd_.get(), name, &p) && ::utimensat(p.fd, p.last.c_str(), times, AT_SYMLINK_NOFOLLOW) == 0;
}

std::vector<TierDir::Entry> TierDir::List(const std::string& name) const {
  std::vector<Entry> out;
  const int fd = OpenBeneath(fd_.get(), name.empty() ? "." : name, O_RDONLY | O_DIRECTORY, 0);
  if (fd < 0) return out;
  DIR* d = ::fdopendir(fd);  // owns fd from here
  if (d == nullptr) {
    ::close(fd);
    return out;
  }
  while (const dirent* e = ::readdir(d)) {  // NOLINT(concurrency-mt-unsafe): one DIR per call
    if (e->d_name[0] != '.') out.push_back({e->d_name, e->d_type});
  }
  ::closedir(d);
  return out;
}

Result<SharedKeys> SharedKeys::Derive(std::span<const std::byte> secret, const std::string& layout_text) {
  if (secret.size() < kMinSecretBytes) {
    return InvalidArgument("the shared tier needs the pool's secret (" + std::to_string(kMinSecretBytes) +
                           "+ bytes): its files are bound to it, so that nothing written without it is read");
  }
  TPUSYNC_ASSIGN_OR_RETURN(MacKey pool, HmacSha256(secret, "tpusync shared tier 2: pool"));
  TPUSYNC_ASSIGN_OR_RETURN(MacKey dir, HmacSha256(pool, "directory"));
  TPUSYNC_ASSIGN_OR_RETURN(MacKey layout, HmacSha256(pool, "layout", BytesOf(layout_text.data(), layout_text.size())));
  uint64_t fingerprint = 0;
  std::memcpy(&fingerprint, layout.data(), sizeof fingerprint);
  TPUSYNC_ASSIGN_OR_RETURN(MacKey header_key, HmacSha256(layout, "header"));
  TPUSYNC_ASSIGN_OR_RETURN(MacKey payload_key, HmacSha256(layout, "payload"));
  TPUSYNC_ASSIGN_OR_RETURN(MacKey record_key, HmacSha256(layout, "record"));
  TPUSYNC_ASSIGN_OR_RETURN(Gmac header, Gmac::Create(header_key));
  TPUSYNC_ASSIGN_OR_RETURN(Gmac payload, Gmac::Create(payload_key));
  TPUSYNC_ASSIGN_OR_RETURN(Gmac record, Gmac::Create(record_key));
  return SharedKeys(Hex(std::span(dir).first(16)), fingerprint, std::move(header), std::move(payload),
                    std::move(record));
}

Status SealBlock(const SharedKeys& keys, uint64_t block_bytes, const BlockKey& key, const std::byte* src,
                 uint64_t length, BlockHeader* h) {
  h->magic = kBlockMagic;
  h->version = kVersion;
  h->block_bytes = block_bytes;
  h->fingerprint = keys.fingerprint();
  h->key_hi = key.hi;
  h->key_lo = key.lo;
  h->length = length;
  TPUSYNC_RETURN_IF_ERROR(FreshIv(h->iv));
  const GmacTag payload = keys.payload().Tag(std::to_array(h->iv), {BytesOf(src, length)});
  std::memcpy(h->payload_tag, payload.data(), payload.size());
  const GmacTag header = HeaderTag(keys, *h);
  std::memcpy(h->header_tag, header.data(), header.size());
  return Status::Ok();
}

bool PlausibleBlockSize(uint64_t file_bytes, uint64_t block_bytes) {
  return file_bytes >= kHeaderBytes + kPageBytes && file_bytes % kPageBytes == 0 &&
         file_bytes <= kHeaderBytes + block_bytes;
}

std::string HeaderProblem(const SharedKeys& keys, uint64_t block_bytes, const BlockKey& key, const BlockHeader& h,
                          uint64_t file_bytes) {
  if (h.magic != kBlockMagic || h.version != kVersion) return "is not a tpusync block file of this version";
  if (!ConstantTimeEqual(HeaderTag(keys, h), BytesOf(h.header_tag, sizeof h.header_tag))) {
    return "fails its header tag (written without this pool's secret, or damaged)";
  }
  if (h.block_bytes != block_bytes || h.fingerprint != keys.fingerprint()) return "belongs to another layout";
  if (h.key_hi != key.hi || h.key_lo != key.lo) return "names another block";
  if (h.length == 0 || h.length > block_bytes || file_bytes != kHeaderBytes + AlignUp(h.length, kPageBytes)) {
    return "has the wrong size";
  }
  return "";
}

bool PayloadVerifies(const SharedKeys& keys, const BlockHeader& h, const std::byte* payload) {
  const GmacTag tag = keys.payload().Tag(std::to_array(h.iv), {BytesOf(payload, h.length)});
  return ConstantTimeEqual(tag, BytesOf(h.payload_tag, sizeof h.payload_tag));
}

Status SealRecord(const SharedKeys& keys, const BlockKey& key, std::span<const std::byte> record, RecordHeader* h) {
  *h = RecordHeader{};
  h->magic = kRecordMagic;
  h->version = kVersion;
  h->length = static_cast<uint32_t>(record.size());
  h->fingerprint = keys.fingerprint();
  h->key_hi = key.hi;
  h->key_lo = key.lo;
  TPUSYNC_RETURN_IF_ERROR(FreshIv(h->iv));
  const GmacTag tag = RecordTag(keys, *h, record);
  std::memcpy(h->tag, tag.data(), tag.size());
  return Status::Ok();
}

bool RecordVerifies(const SharedKeys& keys, const BlockKey& key, const RecordHeader& h,
                    std::span<const std::byte> record) {
  return h.magic == kRecordMagic && h.version == kVersion && h.length == record.size() &&
         h.fingerprint == keys.fingerprint() && h.key_hi == key.hi && h.key_lo == key.lo &&
         ConstantTimeEqual(RecordTag(keys, h, record), BytesOf(h.tag, sizeof h.tag));
}

std::string BlockName(const BlockKey& key) {
  const std::string hex = key.ToHex();
  return hex.substr(0, 2) + "/" + hex;
}

std::string RecordName(const BlockKey& key) { return "records/" + BlockName(key); }

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

}  // namespace tpusync::shared
