#include <algorithm>
#include <cstring>
#include <optional>

#include "base/copy.h"
#include "base/log.h"
#include "base/posix_io.h"
#include "store/store_impl.h"

namespace tpusync {

// ---- put / get ------------------------------------------------------------------------

Status StoreImpl::Put(std::span<const BlockKey> keys, std::span<const ConstBuffer> buffers) {
  if (keys.size() != buffers.size()) {
    return InvalidArgument("put: " + std::to_string(keys.size()) + " keys but " + std::to_string(buffers.size()) +
                           " buffers");
  }
  const uint64_t bb = pool_->block_bytes();
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (buffers[i].size == 0 || buffers[i].size > bb) {
      return InvalidArgument("put: buffer " + std::to_string(i) + " holds " + std::to_string(buffers[i].size) +
                             " bytes; blocks hold 1.." + std::to_string(bb));
    }
  }
  std::unique_lock lock(mu_);
  for (size_t i = 0; i < keys.size(); ++i) {
    TPUSYNC_ASSIGN_OR_RETURN(IndexEntry * e, ClaimLocked(lock, keys[i], WriteDeadline(), true));
    if (e == nullptr) {
      ++c_->put_dedup;
      continue;
    }
    const uint32_t slot = e->slot;
    ++busy_;
    lock.unlock();
    CopyBytes(pool_->data(slot), buffers[i].data, buffers[i].size);
    lock.lock();
    --busy_;
    IndexEntry* w = index_.Find(keys[i]);
    w->writing = false;
    w->length = buffers[i].size;
    pool_->Commit(slot, keys[i], w->length, ++tick_);
    index_.SetDram(*w, slot);
    ++c_->puts;
    c_->bytes_put += w->length;
    QueueSharedLocked(*w);
    MaybeStartWritebackLocked();
    cv_.notify_all();
  }
  return Status::Ok();
}

Status StoreImpl::CopyOutLocked(std::unique_lock<std::mutex>& lock, IndexEntry& e, const MutableBuffer& out) {
  ++e.dram_readers;
  index_.TouchDram(e);
  pool_->Touch(e.slot, ++tick_);
  const std::byte* src = pool_->data(e.slot);
  const BlockKey key = e.key;
  const uint64_t length = e.length;
  ++busy_;
  lock.unlock();
  CopyBytes(out.data, src, length);
  lock.lock();
  --busy_;
  IndexEntry* r = index_.Find(key);  // still present: a block being read is never evicted
  if (--r->dram_readers == 0) cv_.notify_all();
  c_->bytes_got += length;
  return Status::Ok();
}

// Reads a disk block into a fresh DRAM slot, then copies it to `out` if given. When DRAM is
// full of pinned blocks the read goes through a staging buffer instead, without promotion.
// On a failed verification the disk copy is dropped and the error returned (a miss).
Status StoreImpl::PromoteLocked(std::unique_lock<std::mutex>& lock, IndexEntry& entry, const MutableBuffer* out,
                            std::optional<TimePoint> deadline) {
  const BlockKey key = entry.key;
  entry.promoting = true;
  ++entry.disk_readers;
  Result<uint32_t> slot = AcquireSlotLocked(lock, deadline, false);
  IndexEntry* e = index_.Find(key);  // promoting blocks are not evicted
  const uint32_t extent = e->extent;
  const uint64_t length = e->length;
  Status st = slot.status();
  std::optional<AlignedBuffer> staging;
  if (slot.ok() || out != nullptr) {
    if (!slot.ok()) staging.emplace(pool_->block_bytes());
    std::byte* dst = slot.ok() ? pool_->data(*slot) : staging->data();
    ++busy_;
    lock.unlock();
    st = disk_->Read(extent, key, length, dst);
    if (st.ok() && staging) CopyBytes(out->data, dst, length);
    lock.lock();
    --busy_;
    e = index_.Find(key);
  }
  --e->disk_readers;
  e->promoting = false;
  cv_.notify_all();
  if (!st.ok()) {
    if (slot.ok()) pool_->Free(*slot);
    if (st.code() == StatusCode::kResourceExhausted && !slot.ok()) return st;  // no slot; the disk copy is fine
    (st.code() == StatusCode::kDataLoss ? c_->corruptions : c_->disk_read_errors)++;
    RecordErrorLocked(st);
    Log(LogLevel::kWarning, "disk", "block treated as a miss: " + st.message());
    disk_->Free(extent);
    index_.ClearDisk(*e);
    if (!e->in_dram() && e->pins == 0) index_.Erase(key);
    return st;
  }
  if (staging) {
    c_->bytes_got += length;
    return Status::Ok();
  }
  pool_->Commit(*slot, key, length, ++tick_);
  index_.SetDram(*e, *slot);
  ++c_->promotions;
  return out != nullptr ? CopyOutLocked(lock, *e, *out) : Status::Ok();
}

Status StoreImpl::Get(std::span<const BlockKey> keys, std::span<const MutableBuffer> out, std::span<uint8_t> found) {
  if (keys.size() != out.size() || keys.size() != found.size()) {
    return InvalidArgument("get: " + std::to_string(keys.size()) + " keys but " + std::to_string(out.size()) +
                           " output buffers");
  }
  Status result = Status::Ok();
  std::unique_lock lock(mu_);
  size_t prefetched = 0;  // keys before this one have been offered to the read-ahead
  for (size_t i = 0; i < keys.size(); ++i) {
    found[i] = 0;
    // Disk blocks a little ahead of this one are read by the io threads meanwhile.
    for (; prefetched < std::min(keys.size(), i + 1 + read_ahead_); ++prefetched) {
      IndexEntry* p = index_.Find(keys[prefetched]);
      const bool from_disk = p != nullptr && !p->in_dram() && p->on_disk() && !p->promoting;
      const bool from_shared = shared_ && (p == nullptr || (p->tier() == Tier::kNone && !p->writing));
      if (prefetched > i && (from_disk || from_shared)) {
        promote_queue_.push_back(keys[prefetched]);
        cv_.notify_all();
      }
    }
    IndexEntry* e = index_.Find(keys[i]);
    while (e != nullptr && e->promoting) {  // another reader is bringing it up: share its work
      cv_.wait(lock);
      e = index_.Find(keys[i]);
    }
    bool from_shared = false;
    if ((e == nullptr || e->tier() == Tier::kNone) && shared_ && (e == nullptr || !e->writing)) {
      Status st = PromoteSharedLocked(lock, keys[i]);
      if (st.code() == StatusCode::kResourceExhausted || st.code() == StatusCode::kUnavailable) {
        lock.unlock();
        st = ReadSharedStaged(keys[i], out[i]);
        lock.lock();
        if (st.ok()) {
          ++c_->hits_shared;
          c_->bytes_got += out[i].size;
          found[i] = 1;
        } else {
          ++c_->misses;
        }
        continue;
      }
      e = index_.Find(keys[i]);
      from_shared = st.ok();
    }
    if (e == nullptr || e->tier() == Tier::kNone) {
      ++c_->misses;
      continue;
    }
    if (out[i].size < e->length) {
      if (result.ok()) {
        result = InvalidArgument("get: output buffer " + std::to_string(i) + " holds " + std::to_string(out[i].size) +
                                 " bytes, block " + keys[i].ToHex() + " holds " + std::to_string(e->length));
      }
      continue;
    }
    if (out[i].size != e->length) {  // a shorter block would leave the rest of the buffer stale
      ++c_->misses;
      continue;
    }
    if (e->in_dram()) {
      // Counted where the block came from: this get, or its read-ahead.
      const Tier from = from_shared ? Tier::kShared : std::exchange(e->read_ahead_from, Tier::kNone);
      ++(from == Tier::kShared ? c_->hits_shared : from == Tier::kDisk ? c_->hits_disk : c_->hits_dram);
      (void)CopyOutLocked(lock, *e, out[i]);
      found[i] = 1;
    } else if (PromoteLocked(lock, *e, &out[i], WriteDeadline()).ok()) {
      ++c_->hits_disk;
      found[i] = 1;
    } else {
      ++c_->misses;
    }
  }
  return result;
}

}  // namespace tpusync
