#include "tpusync/store.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "base/copy.h"
#include "base/log.h"
#include "base/posix_io.h"
#include "store/store_impl.h"

namespace tpusync {

Result<std::unique_ptr<StoreImpl>> StoreImpl::Open(const StoreOptions& o) {
  std::unique_ptr<StoreImpl> s(new StoreImpl());
  s->c_ = std::make_unique<Counters>();
  TPUSYNC_ASSIGN_OR_RETURN(s->pool_, BlockPool::Create(o.pool));
  if (o.disk_enabled) {
    DiskTierOptions d = o.disk;
    d.block_bytes = s->pool_->block_bytes();
    TPUSYNC_ASSIGN_OR_RETURN(s->disk_, DiskTier::Open(d));
  }
  if (o.shared_enabled) {
    SharedTierOptions sh = o.shared;
    sh.block_bytes = s->pool_->block_bytes();
    sh.on_changed = [feed = &s->feed_](const BlockKey& key) { feed->Record(key); };
    TPUSYNC_ASSIGN_OR_RETURN(s->shared_, SharedTier::Open(sh));
    s->shared_demote_ = o.shared_policy == SharedPolicy::kDemote;
  }
  const uint32_t slots = s->pool_->num_slots();
  s->max_pending_ = std::max<uint32_t>(2, 2 * o.io_threads);
  // At least max_pending_ slots free or on their way out, so every I/O thread always has a
  // block: one checksums its next while another's write is in flight and the disk never
  // waits. A small pool's 5% is one slot, which left one demotion at a time and the disk
  // idle during each checksum (disk put at 0.67 of O_DIRECT in 2 MiB blocks).
  s->writeback_low_ = std::max({uint32_t{1}, static_cast<uint32_t>(slots * o.writeback_watermark),
                                std::min(s->max_pending_, slots / 2)});
  s->write_wait_ = o.write_wait;
  s->read_ahead_ = s->disk_ || s->shared_ ? std::min<size_t>(o.io_threads, slots / 8) : 0;

  // Rebuild the index, oldest first so the newest ends up most recent.
  for (const RecoveredSlot& r : s->pool_->recovered()) {
    IndexEntry& e = s->index_.Insert(r.key);
    e.length = r.length;
    s->index_.SetDram(e, r.slot);
    s->tick_ = std::max(s->tick_, r.tick);
    ++s->c_->recovered_dram;
  }
  if (s->disk_) {
    if (s->disk_->damaged_at_open() > 0) {
      Log(LogLevel::kWarning, "disk",
          std::to_string(s->disk_->damaged_at_open()) + " damaged extent headers in " + s->disk_->path() + " ignored");
      s->c_->corruptions += s->disk_->damaged_at_open();
    }
    for (const RecoveredExtent& r : s->disk_->recovered()) {
      IndexEntry& e = s->index_.Insert(r.key);
      if (e.length != 0 && e.length != r.length) {
        s->disk_->Free(r.extent);  // disagrees with the DRAM copy: the DRAM copy wins
        continue;
      }
      e.length = r.length;
      s->index_.SetDisk(e, r.extent);
      s->seq_ = std::max(s->seq_, r.seq);
      ++s->c_->recovered_disk;
    }
  }
  s->index_.set_feed(&s->feed_);  // after the rebuild: a reader's first batch reads as lost anyway
  if (s->disk_ || s->shared_) {
    for (uint32_t i = 0; i < o.io_threads; ++i) {
      s->io_threads_.emplace_back([p = s.get()](const std::stop_token& st) { p->IoLoop(st); });
    }
  }
  return s;
}

StoreImpl::~StoreImpl() {
  for (auto& t : io_threads_) t.request_stop();
  cv_.notify_all();
  io_threads_.clear();  // joins
}


void StoreImpl::RecordErrorLocked(const Status& st) { c_->last_error = st.ToString(); }

StoreStats StoreImpl::Stats() const {
  std::lock_guard lock(mu_);
  StoreStats s;
  s.block_bytes = pool_->block_bytes();
  s.dram_slots = pool_->num_slots();
  s.dram_used = pool_->num_slots() - pool_->free_slots();
  s.disk_extents = disk_ ? disk_->num_extents() : 0;
  s.disk_used = disk_ ? disk_->num_extents() - disk_->free_extents() : 0;
  s.blocks = index_.size();
  s.pinned = index_.pinned_blocks();
  const Counters& c = *c_;
  s.puts = c.puts, s.put_dedup = c.put_dedup, s.bytes_put = c.bytes_put;
  s.hits_dram = c.hits_dram, s.hits_disk = c.hits_disk, s.misses = c.misses, s.bytes_got = c.bytes_got;
  s.evictions = c.evictions, s.demotions = c.demotions, s.promotions = c.promotions;
  s.disk_evictions = c.disk_evictions;
  s.corruptions = c.corruptions, s.disk_write_errors = c.disk_write_errors, s.disk_read_errors = c.disk_read_errors;
  s.dropped = c.dropped;
  s.recovered_dram = c.recovered_dram, s.recovered_disk = c.recovered_disk;
  s.waiting_writers = waiting_writers_;
  s.hugepages = pool_->hugepages(), s.mlocked = pool_->mlocked(), s.direct_io = disk_ && disk_->direct_io();
  s.hits_shared = c.hits_shared;
  if (shared_) {
    s.shared_enabled = true;
    s.shared = shared_->Stats();
    s.corruptions += s.shared.corruptions;
  }
  s.last_error = c.last_error;
  return s;
}


// ---- the public facade -------------------------------------------------------------------

Store::Store(std::unique_ptr<StoreImpl> impl) : impl_(std::move(impl)) {}
Store::~Store() = default;

Result<std::unique_ptr<Store>> Store::Open(const StoreOptions& options) {
  TPUSYNC_ASSIGN_OR_RETURN(std::unique_ptr<StoreImpl> impl, StoreImpl::Open(options));
  return std::unique_ptr<Store>(new Store(std::move(impl)));
}
Status Store::Put(std::span<const BlockKey> keys, std::span<const ConstBuffer> buffers) {
  return impl_->Put(keys, buffers);
}
Status Store::Get(std::span<const BlockKey> keys, std::span<const MutableBuffer> out, std::span<uint8_t> found) {
  return impl_->Get(keys, out, found);
}
LookupResult Store::Lookup(std::span<const BlockKey> keys, bool pin_prefix) { return impl_->Lookup(keys, pin_prefix); }
Status Store::Pin(std::span<const BlockKey> keys) { return impl_->Pin(keys); }
Status Store::Release(std::span<const BlockKey> keys) { return impl_->Release(keys); }
Status Store::Evict(std::span<const BlockKey> keys) { return impl_->Evict(keys); }
Status Store::Flush() { return impl_->Flush(); }
StoreStats Store::Stats() const { return impl_->Stats(); }
ChangeBatch Store::Changes(ChangeCursor since, std::chrono::milliseconds wait, size_t max_keys) {
  return impl_->feed().Since(since, wait, max_keys);
}
std::vector<Tier> Store::Where(std::span<const BlockKey> keys) { return impl_->Where(keys); }

Status Store::Describe(std::span<const BlockKey> keys, std::span<const std::string> records) {
  SharedTier* shared = impl_->shared();
  if (shared == nullptr) return FailedPrecondition("describe: this store has no shared tier");
  if (keys.size() != records.size()) return InvalidArgument("describe: one record per key");
  for (size_t i = 0; i < keys.size(); ++i) {
    TPUSYNC_RETURN_IF_ERROR(shared->Describe(keys[i], std::as_bytes(std::span(records[i]))));
  }
  return Status::Ok();
}

Result<SharedRecords> Store::Records(std::span<const BlockKey> keys, size_t max_keys) {
  SharedTier* shared = impl_->shared();
  if (shared == nullptr) return FailedPrecondition("records: this store has no shared tier");
  SharedRecords r;
  r.keys = keys.empty() ? shared->Catalog(max_keys) : std::vector<BlockKey>(keys.begin(), keys.end());
  r.records.reserve(r.keys.size());
  for (const BlockKey& k : r.keys) r.records.push_back(shared->Record(k));
  return r;
}
Result<WriteLease> Store::Reserve(const BlockKey& key, bool wait) { return impl_->Reserve(key, wait); }
Result<ReadLease> Store::Acquire(const BlockKey& key) { return impl_->Acquire(key); }
uint64_t Store::block_bytes() const { return impl_->pool().block_bytes(); }
uint32_t Store::num_slots() const { return impl_->pool().num_slots(); }
const std::string& Store::pool_path() const { return impl_->pool().path(); }
std::span<std::byte> Store::pool_memory() const { return impl_->pool().memory(); }

}  // namespace tpusync
