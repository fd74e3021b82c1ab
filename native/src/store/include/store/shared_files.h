// The shared tier's files: where they live, how they are bound to the pool, and how they are
// reached without ever following a link.
//
// Anyone who can write to the shared directory could otherwise plant blocks, records or links
// there. So every block and record carries AES-256-GMAC tags under keys derived from the pool's
// secret (SharedKeys), and every operation below the configured directory goes through a
// directory fd opened once (TierDir), resolving names with RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH
// (openat2) or, where the kernel lacks openat2, one O_NOFOLLOW component at a time: a symlink,
// a device or a directory where a file belongs is the wrong type, never a way out of the tier.
#pragma once

#include <dirent.h>
#include <sys/stat.h>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "base/mac.h"
#include "base/posix_io.h"
#include "tpusync/block_key.h"
#include "tpusync/status.h"

namespace tpusync::shared {

constexpr const char* kTop = "tpusync-shared-v2";  // <dir>/kTop/<pool>/<layout>/...
constexpr uint64_t kHeaderBytes = kPageBytes;      // a block file's header page: the payload stays aligned
constexpr size_t kMinSecretBytes = 16;

// A directory opened once. Names are relative to it and may hold '/' (at most a few components,
// none "..", none a link). Move-only; every call is thread-safe (the fd is only read).
class TierDir {
 public:
  // `path` itself is the operator's configuration and may be a link (a mount point named by a
  // link is common); every name below it is not trusted.
  static Result<TierDir> OpenPath(const std::string& path);
  // `name` below this directory, created (0700) if `create` and absent. kFailedPrecondition
  // naming the entry when it is not a directory (a link, a file).
  Result<TierDir> Sub(const std::string& name, bool create) const;

  // open(2) of `name` below this directory, never through a link; -1 with errno (ELOOP, EXDEV
  // or ENOTDIR for a link on the way) on failure. O_CLOEXEC | O_NOFOLLOW are added.
  UniqueFd Open(const std::string& name, int flags, mode_t mode = 0) const;
  // `name` opened to read its header: O_NONBLOCK (a FIFO planted there must not hang the open)
  // and, where allowed, O_NOATIME (a check is not a use).
  UniqueFd OpenToCheck(const std::string& name) const;
  // lstat of `name` (its last component not followed; earlier ones must be directories, not links).
  bool Stat(const std::string& name, struct stat* st) const;
  bool Unlink(const std::string& name) const;  // the entry itself, whatever it is (never a target)
  // `from` here to `to` below `dest` (both relative, no link followed on the way).
  bool RenameTo(const std::string& from, const TierDir& dest, const std::string& to) const;
  bool SetTimes(const std::string& name, const timespec times[2]) const;  // the entry itself

  struct Entry {
    std::string name;
    unsigned char type;  // DT_REG, DT_DIR, DT_LNK, ... (DT_UNKNOWN: ask Stat)
  };
  // The entries of subdirectory `name` ("" for this one), none starting with '.'; empty if it is
  // absent or not a directory.
  std::vector<Entry> List(const std::string& name = "") const;

  const std::string& path() const { return path_; }  // for messages
  int fd() const { return fd_.get(); }

 private:
  TierDir(UniqueFd fd, std::string path) : fd_(std::move(fd)), path_(std::move(path)) {}
  UniqueFd fd_;
  std::string path_;
};

// The keys of one layout of one pool, derived from the pool's secret by HMAC-SHA256:
//   pool    = HMAC(secret, "tpusync shared tier 2: pool")
//   dir     = hex of HMAC(pool, "directory")[0:16]          the pool's directory name
//   layout  = HMAC(pool, "layout" || layout text)           its first 8 bytes: the fingerprint
//   header, payload, record = HMAC(layout, that word)        the three GMAC keys
// Two pools never share a directory, and nothing written without the secret verifies.
class SharedKeys {
 public:
  static Result<SharedKeys> Derive(std::span<const std::byte> secret, const std::string& layout_text);
  const std::string& pool_dir() const { return pool_dir_; }
  uint64_t fingerprint() const { return fingerprint_; }
  const Gmac& header() const { return header_; }
  const Gmac& payload() const { return payload_; }
  const Gmac& record() const { return record_; }

 private:
  SharedKeys(std::string pool_dir, uint64_t fingerprint, Gmac header, Gmac payload, Gmac record)
      : pool_dir_(std::move(pool_dir)), fingerprint_(fingerprint), header_(std::move(header)),
        payload_(std::move(payload)), record_(std::move(record)) {}
  std::string pool_dir_;
  uint64_t fingerprint_;
  Gmac header_, payload_, record_;
};

// A block file: this header at the start of a 4 KiB page (the rest zero), then the payload
// padded to 4 KiB. The payload tag covers the block's bytes, the header tag every field above
// it (the payload tag included), both under a random IV of the file's own.
struct BlockHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t reserved;
  uint64_t block_bytes;
  uint64_t fingerprint;
  uint64_t key_hi;
  uint64_t key_lo;
  uint64_t length;
  std::byte iv[kGmacIvBytes];
  uint32_t reserved2;
  std::byte payload_tag[kGmacTagBytes];
  std::byte header_tag[kGmacTagBytes];
};

// Fills `out` (a zeroed header page) for `key`'s `length` bytes at `src`.
Status SealBlock(const SharedKeys& keys, uint64_t block_bytes, const BlockKey& key, const std::byte* src,
                 uint64_t length, BlockHeader* out);
// Why `h` is not the header of `key` in a file of `file_bytes` (empty when it is): wrong magic,
// version, layout, key or size, or a header tag that fails (written without the secret).
std::string HeaderProblem(const SharedKeys& keys, uint64_t block_bytes, const BlockKey& key, const BlockHeader& h,
                          uint64_t file_bytes);
bool PayloadVerifies(const SharedKeys& keys, const BlockHeader& h, const std::byte* payload);
// Whether a file of this size could be a block of `block_bytes` at all.
bool PlausibleBlockSize(uint64_t file_bytes, uint64_t block_bytes);

// A record file: this header, then `length` bytes; the tag covers every field above it and the
// record.
struct RecordHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t length;
  uint64_t fingerprint;
  uint64_t key_hi;
  uint64_t key_lo;
  std::byte iv[kGmacIvBytes];
  uint32_t reserved;
  std::byte tag[kGmacTagBytes];
};

Status SealRecord(const SharedKeys& keys, const BlockKey& key, std::span<const std::byte> record, RecordHeader* out);
bool RecordVerifies(const SharedKeys& keys, const BlockKey& key, const RecordHeader& h,
                    std::span<const std::byte> record);

// A block's file name, "<kk>/<key>", and its record's, "records/<kk>/<key>".
std::string BlockName(const BlockKey& key);
std::string RecordName(const BlockKey& key);
// A key from the 32 hex digits BlockKey::ToHex writes; false for any other name.
bool KeyFromHex(std::string_view hex, BlockKey* key);

}  // namespace tpusync::shared
