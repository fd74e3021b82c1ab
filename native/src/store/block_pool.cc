#include "store/block_pool.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "base/posix_io.h"

namespace tpusync {
namespace {

constexpr char kMagic[8] = {'T', 'P', 'U', 'S', 'P', 'O', 'O', 'L'};
constexpr uint32_t kVersion = 1;

enum SlotState : uint32_t { kFree = 0, kWriting = 1, kCommitted = 2 };

struct PoolHeader {
  char magic[8];
  uint32_t version;
  uint32_t reserved;
  uint64_t block_bytes;
  uint64_t num_slots;
  uint64_t meta_offset;
  uint64_t data_offset;
  uint64_t file_bytes;
};

}  // namespace

// One 64-byte record per slot. `state` is published last (release) so a reader that sees
// kCommitted also sees the key, length and data written before it.
struct BlockPool::SlotMeta {
  uint32_t state;
  uint32_t reserved;
  uint64_t key_hi;
  uint64_t key_lo;
  uint64_t length;
  uint64_t tick;
  uint64_t pad[3];
};

BlockPool::SlotMeta* BlockPool::meta(uint32_t slot) const {
  static_assert(sizeof(SlotMeta) == 64);
  auto* first = reinterpret_cast<SlotMeta*>(static_cast<std::byte*>(base_) + kPageBytes);
  return first + slot;
}



namespace {

Status CheckOwnFile(int fd, const std::string& path) {
  struct stat st{};
  if (::fstat(fd, &st) != 0) return ErrnoStatus(errno, "stat pool file " + path);
  if (!S_ISREG(st.st_mode)) return FailedPrecondition("pool file " + path + " is not a regular file");
  const unsigned mode = st.st_mode & 07777;
  if (st.st_uid != ::geteuid() || (mode & 077) != 0) {
    char octal[8];
    std::snprintf(octal, sizeof octal, "%04o", mode);
    return FailedPrecondition("pool file " + path + " is owned by uid " + std::to_string(st.st_uid) + " with mode " +
                              octal + "; this sidecar runs as uid " + std::to_string(::geteuid()) +
                              " and uses only a pool file of its own that no one else can open (mode 0600): "
                              "remove the file, or chown and chmod 600 it if you created it");
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<BlockPool>> BlockPool::Create(const BlockPoolOptions& o) {
  if (o.path.empty()) return InvalidArgument("pool path is empty");
  if (o.block_bytes % kPageBytes != 0) {
    return InvalidArgument("block_bytes " + std::to_string(o.block_bytes) + " is not a multiple of 4096");
  }
  if (o.num_slots > UINT32_MAX) return InvalidArgument("num_slots exceeds 2^32-1");

  // Never through a symlink, and only a file of this user's that no one else can open: every
  // process that can open the pool reads and writes every block in it.
  UniqueFd fd(::open(o.path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd.valid() && errno == ELOOP) {
    return FailedPrecondition("pool file " + o.path + " is a symbolic link; point --pool-path at the file itself");
  }
  if (!fd.valid()) return ErrnoStatus(errno, "open pool file " + o.path);
  TPUSYNC_RETURN_IF_ERROR(CheckOwnFile(fd.get(), o.path));
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) return FailedPrecondition("pool file " + o.path + " is owned by another process");
    return ErrnoStatus(errno, "lock pool file " + o.path);
  }
  struct stat st{};
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, "stat pool file " + o.path);

  PoolHeader h{};
  const bool attach = st.st_size > 0;
  if (attach) {
    if (static_cast<size_t>(st.st_size) < sizeof(h) || ::pread(fd.get(), &h, sizeof(h), 0) != sizeof(h) ||
        std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0) {
      return FailedPrecondition("pool file " + o.path + " exists but is not a tpusync pool");
    }
    if (h.version != kVersion) {
      return FailedPrecondition("pool file " + o.path + " has layout version " + std::to_string(h.version) +
                                ", this build reads " + std::to_string(kVersion));
    }
    if ((o.block_bytes != 0 && o.block_bytes != h.block_bytes) || (o.num_slots != 0 && o.num_slots != h.num_slots)) {
      return FailedPrecondition("pool file " + o.path + " holds " + std::to_string(h.num_slots) + " slots of " +
                                std::to_string(h.block_bytes) + " bytes; requested " + std::to_string(o.num_slots) +
                                " of " + std::to_string(o.block_bytes));
    }
    if (h.file_bytes != static_cast<uint64_t>(st.st_size) || h.block_bytes == 0 || h.block_bytes % kPageBytes ||
        h.meta_offset != kPageBytes || h.data_offset < h.meta_offset + h.num_slots * sizeof(SlotMeta) ||
        h.data_offset + h.num_slots * h.block_bytes > h.file_bytes) {
      return FailedPrecondition("pool file " + o.path + " has an inconsistent header (truncated or damaged)");
    }
  } else {
    if (o.block_bytes == 0 || o.num_slots == 0) {
      return InvalidArgument("new pool file " + o.path + " needs block_bytes and num_slots");
    }
    std::memcpy(h.magic, kMagic, sizeof(kMagic));
    h.version = kVersion;
    h.block_bytes = o.block_bytes;
    h.num_slots = o.num_slots;
    h.meta_offset = kPageBytes;
    // Slot data starts on a huge-page boundary so THP can back it.
    h.data_offset = AlignUp(kPageBytes + o.num_slots * sizeof(SlotMeta), kHugePageBytes);
    h.file_bytes = AlignUp(h.data_offset + o.num_slots * o.block_bytes, kHugePageBytes);
    if (::ftruncate(fd.get(), static_cast<off_t>(h.file_bytes)) != 0) {
      return ErrnoStatus(errno, "size pool file " + o.path);
    }
    // Reserve the memory now: a full /dev/shm is reported here, not as SIGBUS on first touch.
    if (int err = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(h.file_bytes)); err != 0 && err != EOPNOTSUPP) {
      ::ftruncate(fd.get(), 0);
      return ErrnoStatus(err, "reserve " + std::to_string(h.file_bytes) + " bytes for pool file " + o.path);
    }
  }

  int flags = MAP_SHARED | (o.populate ? MAP_POPULATE : 0);
  void* base = ::mmap(nullptr, h.file_bytes, PROT_READ | PROT_WRITE, flags, fd.get(), 0);
  if (base == MAP_FAILED) return ErrnoStatus(errno, "map pool file " + o.path);

  std::unique_ptr<BlockPool> pool(new BlockPool());
  pool->path_ = o.path;
  pool->unlink_on_close_ = o.unlink_on_close;
  pool->base_ = base;
  pool->file_bytes_ = h.file_bytes;
  pool->data_offset_ = h.data_offset;
  pool->data_ = static_cast<std::byte*>(base) + h.data_offset;
  pool->block_bytes_ = h.block_bytes;
  pool->num_slots_ = static_cast<uint32_t>(h.num_slots);
  if (o.hugepages) {
    pool->hugepages_ = ::madvise(pool->data_, h.num_slots * h.block_bytes, MADV_HUGEPAGE) == 0;
  }
  if (o.mlock) pool->mlocked_ = ::mlock(base, h.file_bytes) == 0;
  if (!attach) ::pwrite(fd.get(), &h, sizeof(h), 0);

  std::vector<uint32_t> free;
  free.reserve(pool->num_slots_);
  for (uint32_t s = pool->num_slots_; s-- > 0;) {
    SlotMeta* m = pool->meta(s);
    uint32_t state = std::atomic_ref<uint32_t>(m->state).load(std::memory_order_acquire);
    if (state == kCommitted && m->length > 0 && m->length <= h.block_bytes) {
      pool->recovered_.push_back({s, {m->key_hi, m->key_lo}, m->length, m->tick});
    } else {
      // Never committed, or torn by a writer that died mid-copy: the slot is free.
      std::atomic_ref<uint32_t>(m->state).store(kFree, std::memory_order_relaxed);
      free.push_back(s);
    }
  }
  pool->free_.Assign(std::move(free));
  std::sort(pool->recovered_.begin(), pool->recovered_.end(),
            [](const RecoveredSlot& a, const RecoveredSlot& b) { return a.tick < b.tick; });
  pool->fd_ = std::move(fd);  // the pool keeps the fd, and so the flock, until it closes
  return pool;
}

BlockPool::~BlockPool() {
  if (mlocked_) ::munlock(base_, file_bytes_);
  ::munmap(base_, file_bytes_);
  if (unlink_on_close_) ::unlink(path_.c_str());
}

std::optional<uint32_t> BlockPool::Allocate() {
  std::optional<uint32_t> slot = free_.Take();
  if (slot) std::atomic_ref<uint32_t>(meta(*slot)->state).store(kWriting, std::memory_order_release);
  return slot;
}

void BlockPool::Free(uint32_t slot) {
  std::atomic_ref<uint32_t>(meta(slot)->state).store(kFree, std::memory_order_release);
  free_.Give(slot);
}

void BlockPool::Commit(uint32_t slot, const BlockKey& key, uint64_t length, uint64_t tick) {
  SlotMeta* m = meta(slot);
  m->key_hi = key.hi;
  m->key_lo = key.lo;
  m->length = length;
  m->tick = tick;
  std::atomic_ref<uint32_t>(m->state).store(kCommitted, std::memory_order_release);
}

void BlockPool::Touch(uint32_t slot, uint64_t tick) { meta(slot)->tick = tick; }


}  // namespace tpusync
