// pybind11 module tpusync._native: one class, BlockStore, over the tpusync::BlockStore
// interface, whichever backend serves it (an in-process store, the pod's sidecar, a data
// port). Arguments are converted with the GIL held; the GIL is released around copies, disk
// I/O and network round trips. Only public headers: the backends are private to the engine.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/typing.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "tpusync/block_store.h"
#include "tpusync/net/block_stores.h"

namespace tpusync::py {
namespace {

// The BlockStore and a count of the single-key leases that Python holds on it, so close()
// can refuse while a lease still points into the pool.
class PyBlockStore {
 public:
  explicit PyBlockStore(std::unique_ptr<BlockStore> s) : store_(std::move(s)) {}
  BlockStore& operator*() const { return *store_; }
  BlockStore* operator->() const { return store_.get(); }
  void close() {
    if (leases_ > 0) {
      Raise(FailedPrecondition("cannot close the store: " + std::to_string(leases_) + " leases are still held"));
    }
    pb::gil_scoped_release nogil;  // waits for calls in flight, joins threads, ends the session
    store_->Close();
  }
  int leases_ = 0;  // changed with the GIL held

 private:
  std::unique_ptr<BlockStore> store_;
};

template <typename T>
T Take(Result<T> r) {
  ThrowIfError(r.status());
  return std::move(r).value();
}

// Runs fn with the GIL released: for calls that copy blocks, touch the disk, wait for a slot
// or a peer, or make a round trip to the sidecar.
template <typename Fn>
auto NoGil(Fn&& fn) {
  pb::gil_scoped_release nogil;
  return fn();
}

// The pb::typing return types name their items for the stub generated from this module
// (python/tpusync/_native.pyi, `make stubs`); at run time they are the plain list, tuple and dict.
pb::typing::List<bool> Flags(const std::vector<uint8_t>& v) {
  pb::typing::List<bool> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = pb::bool_(v[i] != 0);
  return out;
}

pb::array_t<uint8_t> TierArray(const std::vector<Tier>& tiers) {
  pb::array_t<uint8_t> a(static_cast<ssize_t>(tiers.size()));
  for (size_t i = 0; i < tiers.size(); ++i) a.mutable_data()[i] = static_cast<uint8_t>(tiers[i]);
  return a;
}

// memoryviews into the mapped pool (None for keys without a slot). Valid until the slots are
// committed, aborted or unacquired: KVStore.reserve_many and acquire_many release them at the
// end of their block.
pb::typing::List<pb::typing::Optional<pb::memoryview>> SlotViews(const std::vector<BlockSlot>& slots, bool readonly) {
  pb::typing::List<pb::typing::Optional<pb::memoryview>> out(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i].data == nullptr) {
      out[i] = pb::none();
    } else {
      out[i] = pb::memoryview::from_memory(slots[i].data, static_cast<ssize_t>(slots[i].size), readonly);
    }
  }
  return out;
}

pb::typing::Dict<pb::str, pb::object> StatsDict(const StoreStats& s) {
  pb::dict d;
  for (const auto& [name, field] : kStoreCounters) d[name] = s.*field;
  for (const auto& [name, field] : kStoreFlags) d[name] = s.*field;
  d["last_error"] = s.last_error;
  pb::dict shared;
  for (const auto& [name, field] : kSharedTierCounters) shared[name] = s.shared.*field;
  shared["direct_io"] = s.shared.direct_io;
  d["shared"] = shared;
  return d;
}

// One key's slot held by a Python object: a WriteLease aborts it unless committed, a
// ReadLease unacquires it. Each keeps its store object alive (pybind11 keep_alive) and counted.
struct PyLease {
  PyLease(PyBlockStore* s, BlockKey k, BlockSlot sl, bool w) : store(s), key(k), slot(sl), write(w) {
    ++store->leases_;
  }
  PyLease(const PyLease&) = delete;
  PyLease& operator=(const PyLease&) = delete;
  ~PyLease() {
    if (!done) {
      try {
        pb::gil_scoped_release nogil;  // a round trip to the sidecar
        (void)(write ? (*store)->Abort({&key, 1}) : (*store)->Unacquire({&key, 1}));
      } catch (...) {  // a destructor must not throw; the session's end gives the slot back anyway
      }
    }
    --store->leases_;
  }
  PyBlockStore* store;
  BlockKey key;
  BlockSlot slot;
  bool write;
  bool done = false;  // committed
};
struct PyWriteLease : PyLease {
  using PyLease::PyLease;
};
struct PyReadLease : PyLease {
  using PyLease::PyLease;
};

// Most methods share one shape: parse the keys, run one call of the store on them with the
// GIL released, then raise its error or convert its value. OnKeys is the first two.
template <auto Call, typename... Args>
auto OnKeys(PyBlockStore& s, const pb::handle& keys, const Args&... args) {
  std::vector<BlockKey> k = ParseKeys(keys);
  return NoGil([&] { return ((*s).*Call)(k, args...); });
}

// The same for the calls on a peer's blocks.
template <auto Call, typename... Args>
auto OnPeerKeys(PyBlockStore& s, const std::string& peer, const pb::handle& keys, const Args&... args) {
  std::vector<BlockKey> k = ParseKeys(keys);
  return NoGil([&] { return ((*s).*Call)(peer, k, args...); });
}

// The methods that return nothing but the call's error.
template <auto Call, typename... Args>
void KeysCall(PyBlockStore& s, const pb::handle& keys, Args... args) {
  ThrowIfError(OnKeys<Call>(s, keys, args...));
}

// reserve (writable views) and acquire (read-only ones).
template <auto Call, bool kReadonly>
pb::typing::List<pb::typing::Optional<pb::memoryview>> KeysViews(PyBlockStore& s, const pb::handle& keys) {
  return SlotViews(Take(OnKeys<Call>(s, keys)), kReadonly);
}

// reserve_lease and acquire_lease: one key's slot as a lease object, refused without a slot.
template <typename Lease>
std::unique_ptr<Lease> OneLease(PyBlockStore& s, const pb::handle& key) {
  constexpr bool kWrite = std::is_same_v<Lease, PyWriteLease>;
  BlockKey k = ParseKey(key);
  std::vector<BlockSlot> slots = Take(NoGil([&] { return kWrite ? s->Reserve({&k, 1}) : s->Acquire({&k, 1}); }));
  if (slots[0].data == nullptr) {
    Raise(kWrite ? FailedPrecondition("reserve: block " + k.ToHex() + " is already stored")
                 : NotFound("acquire: block " + k.ToHex() + " is not stored"));
  }
  return std::make_unique<Lease>(&s, k, slots[0], kWrite);
}

// acquire_leases: many keys' blocks as lease objects, in one call of the store (one round trip
// to a sidecar); None where a block is absent. Each lease keeps the store object alive.
pb::typing::List<pb::typing::Optional<PyReadLease>> ManyLeases(const pb::object& self, const pb::handle& keys) {
  auto& s = self.cast<PyBlockStore&>();
  std::vector<BlockKey> k = ParseKeys(keys);
  std::vector<BlockSlot> slots = Take(NoGil([&] { return s->Acquire(k); }));
  pb::typing::List<pb::typing::Optional<PyReadLease>> out(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i].data == nullptr) {
      out[i] = pb::none();
      continue;
    }
    pb::object lease = pb::cast(std::make_unique<PyReadLease>(&s, k[i], slots[i], false));
    pb::detail::keep_alive_impl(lease, self);  // what keep_alive<0, 1> does for one lease
    out[i] = lease;
  }
  return out;
}

std::unique_ptr<PyBlockStore> OpenLocal(const std::string& pool_path, uint64_t block_bytes, uint64_t num_slots,
                                        std::optional<std::string> disk_dir, uint64_t disk_bytes, bool hugepages,
                                        bool mlock, bool populate, bool unlink_on_close, uint32_t io_threads,
                                        double writeback_watermark, std::optional<pb::bytes> secret, int streams,
                                        int timeout_ms, bool encrypt, std::optional<std::string> shared_dir,
                                        std::string shared_layout, uint64_t shared_bytes,
                                        const std::string& shared_policy, int shared_evict_interval_ms) {
  StoreOptions o;
  o.pool = {.path = pool_path, .block_bytes = block_bytes, .num_slots = num_slots, .hugepages = hugepages,
            .mlock = mlock, .populate = populate, .unlink_on_close = unlink_on_close};
  o.disk_enabled = disk_dir.has_value();
  if (disk_dir) o.disk = {.dir = *disk_dir, .capacity_bytes = disk_bytes};
  o.shared_enabled = shared_dir.has_value();
  if (shared_dir) {
    if (shared_policy != "write-through" && shared_policy != "demote") {
      throw pb::value_error("shared_policy must be 'write-through' or 'demote', not '" + shared_policy + "'");
    }
    o.shared = {.dir = *shared_dir,
                .secret = secret ? std::string(*secret) : std::string(),
                .layout = std::move(shared_layout),
                .capacity_bytes = shared_bytes,
                .evict_interval = std::chrono::milliseconds(shared_evict_interval_ms)};
    o.shared_policy = shared_policy == "demote" ? SharedPolicy::kDemote : SharedPolicy::kWriteThrough;
  }
  o.io_threads = io_threads;
  o.writeback_watermark = writeback_watermark;
  net::PeerOptions peers{.secret = secret ? std::string(*secret) : std::string(), .streams = streams,
                         .connect_timeout = std::chrono::milliseconds(timeout_ms), .encrypt = encrypt};
  // Mapping and pre-faulting a large pool takes a while.
  auto s = NoGil([&] { return net::OpenLocalBlockStore(o, std::move(peers)); });
  return std::make_unique<PyBlockStore>(Take(std::move(s)));
}

std::unique_ptr<PyBlockStore> ConnectSidecar(const std::string& path, int timeout_ms) {
  auto s = NoGil([&] { return net::ConnectSidecar(path, std::chrono::milliseconds(timeout_ms)); });
  return std::make_unique<PyBlockStore>(Take(std::move(s)));
}

std::unique_ptr<PyBlockStore> ConnectDataPort(const std::string& address, const pb::bytes& secret, int streams,
                                              int timeout_ms, bool encrypt) {
  net::PeerOptions o{.secret = std::string(secret), .streams = streams,
                     .connect_timeout = std::chrono::milliseconds(timeout_ms), .encrypt = encrypt};
  auto s = NoGil([&] { return net::ConnectDataPort(address, std::move(o)); });
  return std::make_unique<PyBlockStore>(Take(std::move(s)));
}

void BindLeases(pb::module_& m) {
  pb::class_<PyWriteLease>(m, "WriteLease", pb::buffer_protocol(),
                           "A reserved slot, writable in place through the buffer protocol; given back unless "
                           "committed.")
      .def_buffer([](PyWriteLease& l) {
        if (l.done) Raise(FailedPrecondition("the lease is committed"));
        return pb::buffer_info(reinterpret_cast<uint8_t*>(l.slot.data), static_cast<ssize_t>(l.slot.size), false);
      })
      .def(
          "commit",
          [](PyWriteLease& l, uint64_t length) {
            if (l.done) Raise(FailedPrecondition("commit: lease already committed"));
            Status st = NoGil([&] { return (*l.store)->Commit({&l.key, 1}, {&length, 1}); });
            l.done = true;  // committed or refused: the slot is no longer this lease's
            ThrowIfError(st);
          },
          pb::arg("length"), "Publishes the first `length` bytes of the slot as the block.")
      .def_property_readonly("key", [](PyWriteLease& l) { return KeyToInt(l.key); })
      .def_property_readonly("file_offset", [](PyWriteLease& l) { return l.slot.file_offset; },
                             "Offset of the slot in the pool file, for processes that map it.")
      .def("__len__", [](PyWriteLease& l) { return l.done ? 0 : l.slot.size; });

  pb::class_<PyReadLease>(m, "ReadLease", pb::buffer_protocol(),
                          "A resident block held in DRAM, readable in place; not evicted while alive.")
      .def_buffer([](PyReadLease& l) {
        return pb::buffer_info(reinterpret_cast<uint8_t*>(l.slot.data), static_cast<ssize_t>(l.slot.size), true);
      })
      .def_property_readonly("file_offset", [](PyReadLease& l) { return l.slot.file_offset; })
      .def("__len__", [](PyReadLease& l) { return l.slot.size; });
}

}  // namespace

// (held: list[bool], landed: list[bool], digests: uint64 array): what a pull reports.
PullResult LandedDigests(const std::vector<uint8_t>& held, const std::vector<uint64_t>& digests) {
  pb::list landed(held.size());
  for (size_t i = 0; i < held.size(); ++i) landed[i] = pb::bool_(held[i] == kBlockLanded);
  pb::array_t<uint64_t> d(static_cast<ssize_t>(held.size()));
  std::fill(d.mutable_data(), d.mutable_data() + held.size(), 0);
  std::copy_n(digests.begin(), std::min(digests.size(), held.size()), d.mutable_data());
  return pb::make_tuple(Flags(held), landed, d);
}

PYBIND11_MODULE(_native, m) {
  m.doc() = "tpusync native engine: one block-store interface over an in-process store, the pod's sidecar "
            "and a data port.\n\nKeys (every `keys` argument): a sequence of ints below 2**128 or of 16-byte "
            "big-endian bytes, or a uint64 array of shape (n, 2) ([hi, lo] rows). Buffers: objects with the buffer "
            "protocol, C-contiguous (writable for get).";
  BindLeases(m);

  using S = PyBlockStore;
  pb::class_<S>(m, "BlockStore",
                "A block store, whichever backend serves it; an operation a backend cannot do raises "
                "PreconditionError saying why.")
      .def_static("open_local", &OpenLocal, pb::arg("pool_path"), pb::kw_only(), pb::arg("block_bytes") = 0,
                  pb::arg("num_slots") = 0, pb::arg("disk_dir") = pb::none(), pb::arg("disk_bytes") = 0,
                  pb::arg("hugepages") = false, pb::arg("mlock") = false, pb::arg("populate") = true,
                  pb::arg("unlink_on_close") = false, pb::arg("io_threads") = 2,
                  pb::arg("writeback_watermark") = 0.05, pb::arg("secret") = pb::none(), pb::arg("streams") = 4,
                  pb::arg("timeout_ms") = 5000, pb::arg("encrypt") = false, pb::arg("shared_dir") = pb::none(),
                  pb::arg("shared_layout") = "", pb::arg("shared_bytes") = 0,
                  pb::arg("shared_policy") = "write-through", pb::arg("shared_evict_interval_ms") = 10000,
                  "Opens (or re-attaches to) a store in this process: a shared-memory DRAM pool, an optional "
                  "disk tier, an optional shared tier; with `secret`, transfers with peers' data ports (encrypted with `encrypt`).")
      .def_static("connect_sidecar", &ConnectSidecar, pb::arg("socket_path"), pb::kw_only(),
                  pb::arg("timeout_ms") = 30000,
                  "Connects to the sidecar of this pod over its control socket and maps its pool.")
      .def_static("connect_data_port", &ConnectDataPort, pb::arg("address"), pb::kw_only(), pb::arg("secret"),
                  pb::arg("streams") = 4, pb::arg("timeout_ms") = 5000, pb::arg("encrypt") = false,
                  "Connects to a sidecar's data port (\"host:port\") over parallel authenticated streams "
                  "(encrypted too with `encrypt`).")
      .def(
          "put",
          [](S& s, const pb::handle& keys, const pb::handle& buffers) {
            std::vector<BlockKey> k = ParseKeys(keys);
            Buffers b(buffers, false);
            std::vector<ConstBuffer> views = b.as_const();
            ThrowIfError(NoGil([&] { return s->Put(k, views); }));
          },
          pb::arg("keys"), pb::arg("buffers"), "Stores each buffer under its key; present keys are skipped.")
      .def(
          "get",
          [](S& s, const pb::handle& keys, const pb::handle& buffers) {
            std::vector<BlockKey> k = ParseKeys(keys);
            Buffers b(buffers, true);
            std::vector<MutableBuffer> views = b.as_mutable();
            std::vector<uint8_t> found(k.size());
            ThrowIfError(NoGil([&] { return s->Get(k, views, found); }));
            return Flags(found);
          },
          pb::arg("keys"), pb::arg("buffers"), "Copies present blocks into the buffers; returns found flags.")
      .def(
          "lookup",
          [](S& s, const pb::handle& keys, bool pin) -> pb::typing::Tuple<size_t, pb::array_t<uint8_t>> {
            LookupResult r = Take(OnKeys<&BlockStore::Lookup>(s, keys, pin));
            return pb::make_tuple(r.prefix_len, TierArray(r.tiers));
          },
          pb::arg("keys"), pb::kw_only(), pb::arg("pin") = false,
          "Returns (prefix_len, tiers as uint8 codes); pins the present prefix when pin=True.")
      .def(
          "where", [](S& s, const pb::handle& keys) { return TierArray(Take(OnKeys<&BlockStore::Where>(s, keys))); },
          pb::arg("keys"), "The tier of every key (uint8 codes), the shared tier asked about each.")
      .def(
          "describe",
          [](S& s, const pb::handle& keys, const std::vector<pb::bytes>& records) {
            std::vector<BlockKey> k = ParseKeys(keys);
            std::vector<std::string> r(records.begin(), records.end());
            ThrowIfError(NoGil([&] { return s->Describe(k, r); }));
          },
          pb::arg("keys"), pb::arg("records"), "Writes each block's record on the shared tier (kept if there).")
      .def(
          "records",
          [](S& s, const pb::handle& keys,
             uint32_t max_keys) -> pb::typing::Tuple<pb::typing::List<pb::int_>, pb::typing::List<pb::bytes>> {
            SharedRecords r = Take(OnKeys<&BlockStore::Records>(s, keys, max_keys));
            pb::typing::List<pb::int_> out_keys(r.keys.size());
            pb::typing::List<pb::bytes> out_records(r.keys.size());
            for (size_t i = 0; i < r.keys.size(); ++i) {
              out_keys[i] = KeyToInt(r.keys[i]);
              out_records[i] = pb::bytes(r.records[i]);
            }
            return pb::make_tuple(out_keys, out_records);
          },
          pb::arg("keys"), pb::kw_only(), pb::arg("max_keys") = 65536,
          "(keys, records) of the shared tier: of these keys, or with none the catalog (b'': no record).")
      .def("pin", &KeysCall<&BlockStore::Pin, bool>, pb::arg("keys"), pb::kw_only(), pb::arg("for_host") = false)
      .def("release", &KeysCall<&BlockStore::Release, bool>, pb::arg("keys"), pb::kw_only(),
           pb::arg("for_host") = false)
      .def("evict", &KeysCall<&BlockStore::Evict>, pb::arg("keys"),
           "Moves blocks one tier down: DRAM to disk (or out), disk out.")
      .def(
          "flush", [](S& s) { ThrowIfError(NoGil([&] { return s->Flush(); })); },
          "Waits for queued write-behind; raises the first demotion error since the last flush.")
      .def("stats", [](S& s) { return StatsDict(Take(NoGil([&] { return s->Stats(); }))); })
      .def(
          "changes",
          [](S& s, uint64_t epoch, uint64_t seq, uint32_t wait_ms,
             uint32_t max_keys) -> pb::typing::Tuple<uint64_t, uint64_t, bool, pb::typing::List<pb::int_>> {
            ChangeBatch b = Take(NoGil([&] { return s->Changes({epoch, seq}, std::chrono::milliseconds(wait_ms), max_keys); }));
            pb::typing::List<pb::int_> keys(b.keys.size());
            for (size_t i = 0; i < b.keys.size(); ++i) keys[i] = KeyToInt(b.keys[i]);
            return pb::make_tuple(b.next.epoch, b.next.seq, b.lost, keys);
          },
          pb::arg("epoch"), pb::arg("seq"), pb::kw_only(), pb::arg("wait_ms"), pb::arg("max_keys") = 65536,
          "Keys whose tier changed after the cursor: (epoch, seq, lost, keys) for the next call.")
      .def("reserve", &KeysViews<&BlockStore::Reserve, false>, pb::arg("keys"),
           "Writable views of freshly reserved slots (None where the block is stored); all or nothing.")
      .def("commit", &KeysCall<&BlockStore::Commit, const std::vector<uint64_t>&>, pb::arg("keys"), pb::arg("lengths"),
           "Publishes reserved slots as blocks of the given lengths.")
      .def("abort", &KeysCall<&BlockStore::Abort>, pb::arg("keys"),
           "Gives back reserved slots without committing them.")
      .def("acquire", &KeysViews<&BlockStore::Acquire, true>, pb::arg("keys"),
           "Read-only views of present blocks held in DRAM (None where absent).")
      .def("unacquire", &KeysCall<&BlockStore::Unacquire>, pb::arg("keys"),
           "Releases blocks held by acquire, once per key.")
      .def("reserve_lease", &OneLease<PyWriteLease>, pb::arg("key"), pb::keep_alive<0, 1>(),
           "Reserves one slot as a lease object, to be written in place.")
      .def("acquire_lease", &OneLease<PyReadLease>, pb::arg("key"), pb::keep_alive<0, 1>(),
           "Holds one block in DRAM as a lease object, readable in place.")
      .def("acquire_leases", &ManyLeases, pb::arg("keys"),
           "acquire_lease for many keys in one call (None where a block is absent).")
      .def(
          "pull_from",
          [](S& s, const std::string& peer, const pb::handle& keys, bool digests) {
            PullReport r = Take(OnPeerKeys<&BlockStore::PullFrom>(s, peer, keys, digests));
            return LandedDigests(r.held, r.digests);
          },
          pb::arg("peer"), pb::arg("keys"), pb::arg("digests") = false,
          "Pulls the blocks this store lacks from a peer's data port; returns (held, landed, digests): with "
          "digests=True, the XXH3-64 of each block that landed in this pull (computed as it arrived), else 0.")
      .def(
          "push_to",
          [](S& s, const std::string& peer, const pb::handle& keys) {
            return Flags(Take(OnPeerKeys<&BlockStore::PushTo>(s, peer, keys)));
          },
          pb::arg("peer"), pb::arg("keys"), "Pushes stored blocks to a peer; returns which the peer holds.")
      .def(
          "exists_at",
          [](S& s, const std::string& peer, const pb::handle& keys) {
            return TierArray(Take(OnPeerKeys<&BlockStore::ExistsAt>(s, peer, keys)));
          },
          pb::arg("peer"), pb::arg("keys"), "The peer's tier of each block (uint8 codes); nothing moves.")
      .def("close", &S::close, "Ends the session or closes the store; refused while leases are held.")
      .def_property_readonly("block_bytes", [](S& s) { return s->block_bytes(); })
      .def_property_readonly(
          "pool_path",
          [](S& s) -> std::optional<std::string> {
            if (s->pool_path().empty()) return std::nullopt;
            return s->pool_path();
          },
          "The shared-memory pool file, or None for a data port.")
      .def(
          "pool_region",
          [](S& s) -> std::optional<std::pair<uintptr_t, size_t>> {
            std::span<std::byte> m = s->pool_memory();
            if (m.empty()) return std::nullopt;
            return std::pair{reinterpret_cast<uintptr_t>(m.data()), m.size()};
          },
          "The pool as mapped in this process, (address, bytes), every slot's view within it: to register it "
          "with a device runtime as page-locked host memory (cudaHostRegister). None for a data port.");
}

}  // namespace tpusync::py
