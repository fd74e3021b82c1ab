// pybind11 module tpusync._native: a thin, typed layer over tpusync::Store.
// Arguments are converted with the GIL held; the GIL is released around copies and disk I/O.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <optional>

#include "convert.h"
#include "net/peer_client.h"
#include "tpusync/store.h"

namespace tpusync::py {
namespace {

// Owns the Store so close() can free it while Python references remain. Each call holds a
// reference for its duration (the GIL is released inside), so close() from another thread
// frees the Store only after calls already running have returned.
class PyStore {
 public:
  explicit PyStore(std::unique_ptr<Store> s) : store_(std::move(s)) {}
  std::shared_ptr<Store> get() {  // with the GIL held, like close()'s hand-off below
    if (!store_) Raise(FailedPrecondition("the store is closed"));
    return store_;
  }
  void close() {
    if (leases_ > 0) {
      Raise(FailedPrecondition("cannot close the store: " + std::to_string(leases_) + " leases are still held"));
    }
    std::shared_ptr<Store> doomed = std::move(store_);
    pb::gil_scoped_release nogil;  // joins the write-behind threads (if no call still holds it)
    doomed.reset();
  }
  int leases_ = 0;

 private:
  std::shared_ptr<Store> store_;
};

// A lease keeps its store object alive (pybind11 keep_alive) and counted.
template <typename Lease>
struct PyLease {
  PyLease(Lease l, PyStore* s) : lease(std::move(l)), store(s) { ++store->leases_; }
  ~PyLease() {
    lease.reset();
    --store->leases_;
  }
  std::optional<Lease> lease;
  PyStore* store;
};
using PyWriteLease = PyLease<WriteLease>;
using PyReadLease = PyLease<ReadLease>;

std::unique_ptr<PyStore> OpenStore(const std::string& pool_path, uint64_t block_bytes, uint64_t num_slots,
                                   std::optional<std::string> disk_dir, uint64_t disk_bytes, bool hugepages,
                                   bool mlock, bool populate, bool unlink_on_close, uint32_t io_threads,
                                   double writeback_watermark) {
  StoreOptions o;
  o.pool = {.path = pool_path, .block_bytes = block_bytes, .num_slots = num_slots, .hugepages = hugepages,
            .mlock = mlock, .populate = populate, .unlink_on_close = unlink_on_close};
  o.disk_enabled = disk_dir.has_value();
  if (disk_dir) o.disk = {.dir = *disk_dir, .capacity_bytes = disk_bytes};
  o.io_threads = io_threads;
  o.writeback_watermark = writeback_watermark;
  Result<std::unique_ptr<Store>> s = [&] {
    pb::gil_scoped_release nogil;  // mapping and pre-faulting a large pool takes a while
    return Store::Open(o);
  }();
  ThrowIfError(s.status());
  return std::make_unique<PyStore>(std::move(s).value());
}

pb::dict StatsDict(const StoreStats& s) {
  pb::dict d;
#define TPUSYNC_STAT(name) d[#name] = s.name
  TPUSYNC_STAT(block_bytes);
  TPUSYNC_STAT(dram_slots);
  TPUSYNC_STAT(dram_used);
  TPUSYNC_STAT(disk_extents);
  TPUSYNC_STAT(disk_used);
  TPUSYNC_STAT(blocks);
  TPUSYNC_STAT(pinned);
  TPUSYNC_STAT(puts);
  TPUSYNC_STAT(put_dedup);
  TPUSYNC_STAT(bytes_put);
  TPUSYNC_STAT(hits_dram);
  TPUSYNC_STAT(hits_disk);
  TPUSYNC_STAT(misses);
  TPUSYNC_STAT(bytes_got);
  TPUSYNC_STAT(evictions);
  TPUSYNC_STAT(demotions);
  TPUSYNC_STAT(promotions);
  TPUSYNC_STAT(disk_evictions);
  TPUSYNC_STAT(corruptions);
  TPUSYNC_STAT(disk_write_errors);
  TPUSYNC_STAT(dropped);
  TPUSYNC_STAT(disk_read_errors);
  TPUSYNC_STAT(recovered_dram);
  TPUSYNC_STAT(recovered_disk);
  TPUSYNC_STAT(hugepages);
  TPUSYNC_STAT(mlocked);
  TPUSYNC_STAT(direct_io);
  TPUSYNC_STAT(last_error);
#undef TPUSYNC_STAT
  return d;
}

}  // namespace

void BindNet(pb::module_& m);  // net_bindings.cc

PYBIND11_MODULE(_native, m) {
  m.doc() = "tpusync native engine: shared-memory DRAM block pool, disk tier, block index.";

  pb::class_<PyWriteLease>(m, "WriteLease", pb::buffer_protocol(),
                           "A reserved DRAM slot, writable in place through the buffer protocol.")
      .def_buffer([](PyWriteLease& l) {
        if (!l.lease) Raise(FailedPrecondition("the lease is committed"));
        return pb::buffer_info(reinterpret_cast<uint8_t*>(l.lease->data()), static_cast<ssize_t>(l.lease->capacity()), false);
      })
      .def(
          "commit",
          [](PyWriteLease& l, uint64_t length) {
            if (!l.lease) Raise(FailedPrecondition("commit: lease already committed"));
            ThrowIfError(l.lease->Commit(length));
            l.lease.reset();
          },
          pb::arg("length"), "Publishes the first `length` bytes of the slot as the block.")
      .def_property_readonly("key", [](PyWriteLease& l) { return KeyToInt(l.lease->key()); })
      .def_property_readonly("file_offset", [](PyWriteLease& l) { return l.lease->file_offset(); },
                             "Offset of the slot in the pool file, for processes that map it.")
      .def("__len__", [](PyWriteLease& l) { return l.lease ? l.lease->capacity() : 0; });

  pb::class_<PyReadLease>(m, "ReadLease", pb::buffer_protocol(),
                          "A resident block held in DRAM, readable in place; not evicted while alive.")
      .def_buffer([](PyReadLease& l) {
        return pb::buffer_info(reinterpret_cast<uint8_t*>(const_cast<std::byte*>(l.lease->data())),
                               static_cast<ssize_t>(l.lease->size()), true);
      })
      .def_property_readonly("file_offset", [](PyReadLease& l) { return l.lease->file_offset(); })
      .def("__len__", [](PyReadLease& l) { return l.lease->size(); });

  pb::class_<PyStore>(m, "Store", "A host block store: shared-memory DRAM pool plus optional disk tier.")
      .def(pb::init(&OpenStore), pb::arg("pool_path"), pb::kw_only(), pb::arg("block_bytes") = 0,
           pb::arg("num_slots") = 0, pb::arg("disk_dir") = pb::none(), pb::arg("disk_bytes") = 0,
           pb::arg("hugepages") = false, pb::arg("mlock") = false, pb::arg("populate") = true,
           pb::arg("unlink_on_close") = false, pb::arg("io_threads") = 2, pb::arg("writeback_watermark") = 0.05)
      .def(
          "put",
          [](PyStore& s, const pb::handle& keys, const pb::handle& buffers) {
            std::vector<BlockKey> k = ParseKeys(keys);
            Buffers b(buffers, false);
            std::vector<ConstBuffer> views = b.as_const();
            Status st;
            std::shared_ptr<Store> in_use = s.get();
            Store& store = *in_use;
            {
              pb::gil_scoped_release nogil;  // copies into the pool
              st = store.Put(k, views);
            }
            ThrowIfError(st);
          },
          pb::arg("keys"), pb::arg("buffers"), "Stores each buffer under its key; present keys are skipped.")
      .def(
          "get",
          [](PyStore& s, const pb::handle& keys, const pb::handle& buffers) {
            std::vector<BlockKey> k = ParseKeys(keys);
            Buffers b(buffers, true);
            std::vector<MutableBuffer> views = b.as_mutable();
            std::vector<uint8_t> found(k.size());
            std::shared_ptr<Store> in_use = s.get();
            Store& store = *in_use;
            Status st;
            {
              pb::gil_scoped_release nogil;  // copies out of the pool, reads from disk
              st = store.Get(k, views, found);
            }
            ThrowIfError(st);
            pb::list out(found.size());
            for (size_t i = 0; i < found.size(); ++i) out[i] = pb::bool_(found[i] != 0);
            return out;
          },
          pb::arg("keys"), pb::arg("buffers"), "Copies present blocks into the buffers; returns found flags.")
      .def(
          "lookup",
          [](PyStore& s, const pb::handle& keys, bool pin) {
            std::vector<BlockKey> k = ParseKeys(keys);
            LookupResult r;
            std::shared_ptr<Store> in_use = s.get();
            Store& store = *in_use;
            {
              pb::gil_scoped_release nogil;
              r = store.Lookup(k, pin);
            }
            pb::array_t<uint8_t> tiers(static_cast<ssize_t>(r.tiers.size()));
            std::memcpy(tiers.mutable_data(), r.tiers.data(), r.tiers.size());  // Tier is a uint8_t enum
            return pb::make_tuple(r.prefix_len, tiers);
          },
          pb::arg("keys"), pb::kw_only(), pb::arg("pin") = false,
          "Returns (prefix_len, tiers as uint8 codes); pins the present prefix when pin=True.")
      // An in-process store has no connections: every pin is the host's (for_host is moot).
      .def(
          "pin", [](PyStore& s, const pb::handle& keys, bool) { ThrowIfError(s.get()->Pin(ParseKeys(keys))); },
          pb::arg("keys"), pb::kw_only(), pb::arg("for_host") = false)
      .def(
          "release", [](PyStore& s, const pb::handle& keys, bool) { ThrowIfError(s.get()->Release(ParseKeys(keys))); },
          pb::arg("keys"), pb::kw_only(), pb::arg("for_host") = false)
      .def(
          "evict",
          [](PyStore& s, const pb::handle& keys) {
            std::vector<BlockKey> k = ParseKeys(keys);
            std::shared_ptr<Store> in_use = s.get();
            Store& store = *in_use;
            Status st;
            {
              pb::gil_scoped_release nogil;  // writes to disk
              st = store.Evict(k);
            }
            ThrowIfError(st);
          },
          pb::arg("keys"), "Moves blocks one tier down: DRAM to disk (or out), disk out.")
      .def(
          "flush",
          [](PyStore& s) {
            std::shared_ptr<Store> in_use = s.get();
            Store& store = *in_use;
            Status st;
            {
              pb::gil_scoped_release nogil;  // waits for write-behind
              st = store.Flush();
            }
            ThrowIfError(st);
          },
          "Waits for queued write-behind; raises the first demotion error since the last flush.")
      .def("stats", [](PyStore& s) { return StatsDict(s.get()->Stats()); })
      .def(
          "reserve",
          [](PyStore& s, const pb::handle& key) {
            BlockKey k = ParseKey(key);
            std::shared_ptr<Store> in_use = s.get();
            Store& store = *in_use;
            std::optional<Result<WriteLease>> r;
            {
              pb::gil_scoped_release nogil;  // may wait for a slot
              r.emplace(store.Reserve(k));
            }
            ThrowIfError(r->status());
            return std::make_unique<PyWriteLease>(std::move(*r).value(), &s);
          },
          pb::arg("key"), pb::keep_alive<0, 1>(), "Reserves a DRAM slot for key, to be written in place.")
      .def(
          "acquire",
          [](PyStore& s, const pb::handle& key) {
            BlockKey k = ParseKey(key);
            std::shared_ptr<Store> in_use = s.get();
            Store& store = *in_use;
            std::optional<Result<ReadLease>> r;
            {
              pb::gil_scoped_release nogil;  // may promote from disk
              r.emplace(store.Acquire(k));
            }
            ThrowIfError(r->status());
            return std::make_unique<PyReadLease>(std::move(*r).value(), &s);
          },
          pb::arg("key"), pb::keep_alive<0, 1>(), "Holds a block in DRAM for reading in place.")
      .def("close", &PyStore::close, "Frees the pool mapping and stops the write-behind threads.")
      .def_property_readonly("pool_path", [](PyStore& s) { return s.get()->pool().path(); })
      .def_property_readonly("block_bytes", [](PyStore& s) { return s.get()->pool().block_bytes(); })
      .def_property_readonly("num_slots", [](PyStore& s) { return s.get()->pool().num_slots(); })
      .def(
          "pull_from",
          [](PyStore& s, net::PeerClient& peer, const pb::handle& keys, int timeout_ms, bool digests) -> pb::object {
            std::vector<BlockKey> k = ParseKeys(keys);
            std::shared_ptr<Store> in_use = s.get();
            Store& store = *in_use;
            net::PullResult pulled;
            Status st;
            {
              pb::gil_scoped_release nogil;  // a network transfer into the pool
              st = net::PullIntoStore(peer, store, k, net::Deadline::After(std::chrono::milliseconds(timeout_ms)),
                                      pulled);
            }
            // As through the sidecar: a peer that fails part-way raises, after the blocks that
            // arrived whole were kept.
            ThrowIfError(st);
            if (digests) return LandedDigests(pulled.held, pulled.digests);
            pb::list out(pulled.held.size());
            for (size_t i = 0; i < pulled.held.size(); ++i) out[i] = pb::bool_(pulled.held[i] != 0);
            return out;
          },
          pb::arg("peer"), pb::arg("keys"), pb::kw_only(), pb::arg("timeout_ms") = 120000, pb::arg("digests") = false,
          "Pulls the blocks this store lacks from a peer; returns which are held afterwards (with digests: "
          "(held, landed, digests), the XXH3-64 of each block that landed).");

  BindNet(m);
}

}  // namespace tpusync::py
