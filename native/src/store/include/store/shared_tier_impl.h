// What SharedTier's two source files share: its keys and directories (shared_tier.cc does the
// block I/O, shared_evict.cc the pass over the pool).
#pragma once

#include <sys/stat.h>
#include <sys/statvfs.h>

#include <cstdio>
#include <string>
#include <unordered_map>

#include "store/shared_files.h"
#include "store/shared_tier.h"

namespace tpusync {

struct SharedTier::Files {
  shared::SharedKeys keys;
  shared::TierDir pool;  // <dir>/tpusync-shared-v2/<pool>: every layout of the pool
  shared::TierDir root;  // pool/<fingerprint>: this layout
  shared::TierDir tmp;   // root/tmp
  // Files whose header verified, by key (guarded by the tier's mu_); forgotten all at once
  // past kMaxVerified, then checked again as they are met.
  std::unordered_map<BlockKey, FileId, BlockKeyHash> verified;
  static constexpr size_t kMaxVerified = size_t{1} << 20;
  void Remember(const BlockKey& key, const FileId& id) {
    if (verified.size() >= kMaxVerified) verified.clear();
    verified[key] = id;
  }
};

inline std::string Hex16(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

inline int64_t Nanoseconds(const timespec& t) { return int64_t{t.tv_sec} * 1000000000 + t.tv_nsec; }

// A file's identity as a header check saw it (Id is SharedTier::FileId, private to the tier).
template <typename Id>
Id IdOf(const struct stat& st) {
  return {static_cast<uint64_t>(st.st_ino), static_cast<uint64_t>(st.st_size), Nanoseconds(st.st_mtim),
          Nanoseconds(st.st_ctim)};
}

// A filesystem as df counts it for the ones writing to it: the bytes in use and the bytes they
// can use at most (in use plus available). Blocks reserved for root, or withheld by the
// storage below (this project's VMs show a 252 GB disk with 92 GB usable), count as neither;
// counted as used, they made a half-empty filesystem look 85 % full to the evictor.
struct FsUse {
  uint64_t used = 0, size = 0;
};

inline bool UsageOf(int dir_fd, FsUse* out) {
  struct statvfs vfs{};
  if (::fstatvfs(dir_fd, &vfs) != 0) return false;
  out->used = (uint64_t{vfs.f_blocks} - vfs.f_bfree) * vfs.f_frsize;
  out->size = out->used + uint64_t{vfs.f_bavail} * vfs.f_frsize;
  return true;
}

}  // namespace tpusync
