// Bindings for the network clients: SidecarClient (control channel) and PeerClient (data port).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sstream>

#include "convert.h"
#include "net/control_client.h"
#include "net/control_service.h"
#include "net/peer_client.h"

namespace tpusync::py {
namespace {

using net::Deadline;

pb::list Flags(const std::vector<uint8_t>& v) {
  pb::list out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = pb::bool_(v[i] != 0);
  return out;
}

}  // namespace

// (held: list[bool], landed: list[bool], digests: uint64 array): what a pull reports.
pb::tuple LandedDigests(const std::vector<uint8_t>& held, const std::vector<uint64_t>& digests) {
  pb::list landed(held.size());
  for (size_t i = 0; i < held.size(); ++i) landed[i] = pb::bool_(held[i] == net::kLanded);
  pb::array_t<uint64_t> d(static_cast<ssize_t>(digests.size()));
  std::copy(digests.begin(), digests.end(), d.mutable_data());
  return pb::make_tuple(Flags(held), landed, d);
}

namespace {

pb::array_t<uint8_t> TierArray(const std::vector<Tier>& tiers) {
  pb::array_t<uint8_t> a(static_cast<ssize_t>(tiers.size()));
  for (size_t i = 0; i < tiers.size(); ++i) a.mutable_data()[i] = static_cast<uint8_t>(tiers[i]);
  return a;
}

pb::dict StatsText(const std::string& text) {
  pb::dict d;
  std::istringstream in(text);
  std::string name;
  uint64_t value;
  while (in >> name >> value) d[pb::str(name)] = value;
  return d;
}

// memoryviews into the mapped pool (None for keys without a slot). They are valid while the
// client lives and until the slots are committed or unacquired: KVStore.reserve_many and
// acquire_many release them at the end of their block.
pb::list SlotViews(const std::vector<net::SidecarClient::SlotView>& views, bool readonly) {
  pb::list out(views.size());
  for (size_t i = 0; i < views.size(); ++i) {
    if (views[i].data == nullptr) {
      out[i] = pb::none();
    } else {
      out[i] = pb::memoryview::from_memory(views[i].data, static_cast<ssize_t>(views[i].size), readonly);
    }
  }
  return out;
}

// Lands pulled blocks straight in the caller's buffers.
class BufferSink : public net::BlockSink {
 public:
  explicit BufferSink(std::vector<MutableBuffer> out) : out_(std::move(out)) {}
  std::byte* Begin(size_t i, uint64_t length) override { return length <= out_[i].size ? out_[i].data : nullptr; }
  void Finish(size_t, uint64_t, bool, uint64_t) override {}

 private:
  std::vector<MutableBuffer> out_;
};

class BufferSource : public net::BlockSource {
 public:
  explicit BufferSource(std::vector<ConstBuffer> in) : in_(std::move(in)) {}
  Result<std::span<const std::byte>> Open(size_t i) override { return std::span(in_[i].data, in_[i].size); }
  void Close(size_t) override {}

 private:
  std::vector<ConstBuffer> in_;
};

template <typename T>
T Take(Result<T> r) {
  ThrowIfError(r.status());
  return std::move(r).value();
}

}  // namespace

void BindNet(pb::module_& m) {
  using net::PeerClient;
  using net::SidecarClient;

  pb::class_<SidecarClient>(m, "SidecarClient",
                            "An engine's handle on the sidecar in its pod: maps the sidecar's pool file and copies "
                            "blocks itself; the UNIX control socket hands out slots and pins.")
      .def(pb::init([](const std::string& path, int timeout_ms) {
             auto r = [&] {
               pb::gil_scoped_release nogil;  // connects and maps the pool
               return SidecarClient::Connect(path, std::chrono::milliseconds(timeout_ms));
             }();
             return Take(std::move(r));
           }),
           pb::arg("socket_path"), pb::kw_only(), pb::arg("timeout_ms") = 30000)
      .def(
          "put",
          [](SidecarClient& c, const pb::handle& keys, const pb::handle& buffers) {
            auto k = ParseKeys(keys);
            Buffers b(buffers, false);
            auto views = b.as_const();
            Status st;
            {
              pb::gil_scoped_release nogil;  // copies into the mapped pool
              st = c.Put(k, views);
            }
            ThrowIfError(st);
          },
          pb::arg("keys"), pb::arg("buffers"))
      .def(
          "get",
          [](SidecarClient& c, const pb::handle& keys, const pb::handle& buffers) {
            auto k = ParseKeys(keys);
            Buffers b(buffers, true);
            auto views = b.as_mutable();
            std::vector<uint8_t> found(k.size());
            Status st;
            {
              pb::gil_scoped_release nogil;  // copies out of the mapped pool
              st = c.Get(k, views, found);
            }
            ThrowIfError(st);
            return Flags(found);
          },
          pb::arg("keys"), pb::arg("buffers"))
      .def(
          "lookup",
          [](SidecarClient& c, const pb::handle& keys, bool pin) {
            auto k = ParseKeys(keys);
            Result<LookupResult> r = [&] {
              pb::gil_scoped_release nogil;
              return c.Lookup(k, pin);
            }();
            ThrowIfError(r.status());
            return pb::make_tuple(r->prefix_len, TierArray(r->tiers));
          },
          pb::arg("keys"), pb::kw_only(), pb::arg("pin") = false)
      .def(
          "pin", [](SidecarClient& c, const pb::handle& keys, bool for_host) { ThrowIfError(c.Pin(ParseKeys(keys), for_host)); },
          pb::arg("keys"), pb::kw_only(), pb::arg("for_host") = false)
      .def(
          "release",
          [](SidecarClient& c, const pb::handle& keys, bool for_host) { ThrowIfError(c.Release(ParseKeys(keys), for_host)); },
          pb::arg("keys"), pb::kw_only(), pb::arg("for_host") = false)
      .def("evict",
           [](SidecarClient& c, const pb::handle& keys) {
             auto k = ParseKeys(keys);
             pb::gil_scoped_release nogil;  // the sidecar may write to disk
             Status st = c.Evict(k);
             pb::gil_scoped_acquire gil;
             ThrowIfError(st);
           },
           pb::arg("keys"), "Drops the blocks from the sidecar's DRAM and disk tiers.")
      .def("flush",
           [](SidecarClient& c) {
             Status st;
             {
               pb::gil_scoped_release nogil;
               st = c.Flush();
             }
             ThrowIfError(st);
           })
      .def("stats", [](SidecarClient& c) { return StatsText(Take(c.Stats())); })
      .def("close", &SidecarClient::Close, pb::call_guard<pb::gil_scoped_release>(),
           "Ends the session: the sidecar drops this client's pins and leases.")
      .def(
          "read_remote",
          [](SidecarClient& c, const std::string& peer, const pb::handle& keys) {
            auto k = ParseKeys(keys);
            Result<std::vector<uint8_t>> r = [&] {
              pb::gil_scoped_release nogil;  // a network transfer
              return c.PullFrom(peer, k);
            }();
            return Flags(Take(std::move(r)));
          },
          pb::arg("peer"), pb::arg("keys"), "Has the sidecar pull the blocks it lacks from a peer.")
      .def(
          "read_remote_digests",
          [](SidecarClient& c, const std::string& peer, const pb::handle& keys) {
            auto k = ParseKeys(keys);
            std::vector<uint64_t> digests;
            Result<std::vector<uint8_t>> r = [&] {
              pb::gil_scoped_release nogil;  // a network transfer
              return c.PullFrom(peer, k, &digests);
            }();
            return LandedDigests(Take(std::move(r)), digests);
          },
          pb::arg("peer"), pb::arg("keys"),
          "read_remote, returning (held, landed, digests): the XXH3-64 of each block that landed in this pull.")
      .def(
          "push_remote",
          [](SidecarClient& c, const std::string& peer, const pb::handle& keys) {
            auto k = ParseKeys(keys);
            Result<std::vector<uint8_t>> r = [&] {
              pb::gil_scoped_release nogil;
              return c.PushTo(peer, k);
            }();
            return Flags(Take(std::move(r)));
          },
          pb::arg("peer"), pb::arg("keys"))
      .def(
          "exists_remote",
          [](SidecarClient& c, const std::string& peer, const pb::handle& keys) {
            auto k = ParseKeys(keys);
            Result<std::vector<uint8_t>> r = [&] {
              pb::gil_scoped_release nogil;
              return c.ExistsAt(peer, k);
            }();
            auto v = Take(std::move(r));
            pb::array_t<uint8_t> a(static_cast<ssize_t>(v.size()));
            std::copy(v.begin(), v.end(), a.mutable_data());
            return a;
          },
          pb::arg("peer"), pb::arg("keys"))
      .def(
          "reserve",
          [](SidecarClient& c, const pb::handle& keys) {
            auto k = ParseKeys(keys);
            Result<std::vector<SidecarClient::SlotView>> r = [&] {
              pb::gil_scoped_release nogil;  // the sidecar may wait for a slot or another writer
              return c.Reserve(k);
            }();
            auto views = Take(std::move(r));
            std::vector<BlockKey> reserved;
            bool no_room = false, busy = false;
            for (size_t i = 0; i < views.size(); ++i) {
              if (views[i].data != nullptr) reserved.push_back(k[i]);
              no_room |= views[i].code == net::kSlotNoRoom;
              busy |= views[i].code == net::kSlotBusy;
            }
            if (no_room || busy) {  // all or nothing: give back what was reserved
              ThrowIfError(c.Abort(reserved));
              ThrowIfError(no_room ? ResourceExhausted("reserve: the sidecar has no free slot for every block")
                                   : Status(StatusCode::kUnavailable,
                                            "reserve: another connection is writing one of these blocks"));
            }
            return SlotViews(views, false);
          },
          pb::arg("keys"),
          "Writable views of freshly reserved slots (None where the block is stored or no slot is free).")
      .def(
          "commit",
          [](SidecarClient& c, const pb::handle& keys, const std::vector<uint64_t>& lengths) {
            ThrowIfError(c.Commit(ParseKeys(keys), lengths));
          },
          pb::arg("keys"), pb::arg("lengths"))
      .def(
          "abort", [](SidecarClient& c, const pb::handle& keys) { ThrowIfError(c.Abort(ParseKeys(keys))); },
          pb::arg("keys"), "Gives back reserved slots without committing them.")
      .def(
          "acquire",
          [](SidecarClient& c, const pb::handle& keys) {
            auto k = ParseKeys(keys);
            Result<std::vector<SidecarClient::SlotView>> r = [&] {
              pb::gil_scoped_release nogil;  // may promote blocks from disk
              return c.Acquire(k);
            }();
            return SlotViews(Take(std::move(r)), true);
          },
          pb::arg("keys"), "Read-only views of present blocks (None where absent).")
      .def(
          "unacquire", [](SidecarClient& c, const pb::handle& keys) { ThrowIfError(c.Unacquire(ParseKeys(keys))); },
          pb::arg("keys"), "Releases blocks held by acquire.")
      .def_property_readonly("block_bytes", &SidecarClient::block_bytes)
      .def_property_readonly("pool_path", &SidecarClient::pool_path);

  pb::class_<PeerClient>(m, "PeerClient",
                         "A direct, authenticated client of a sidecar's data port over parallel streams.")
      .def(pb::init([](const std::string& address, const pb::bytes& secret, int streams, int timeout_ms) {
             std::string s = secret;
             auto r = [&] {
               pb::gil_scoped_release nogil;  // connects and authenticates every stream
               return PeerClient::Connect(address, net::Secret(s),
                                          {.streams = streams, .connect_timeout = std::chrono::milliseconds(timeout_ms)});
             }();
             return Take(std::move(r));
           }),
           pb::arg("address"), pb::kw_only(), pb::arg("secret"), pb::arg("streams") = 4,
           pb::arg("timeout_ms") = 5000)
      .def(
          "exists",
          [](PeerClient& c, const pb::handle& keys, int timeout_ms) {
            auto k = ParseKeys(keys);
            Result<std::vector<Tier>> r = [&] {
              pb::gil_scoped_release nogil;
              return c.Exists(k, Deadline::After(std::chrono::milliseconds(timeout_ms)));
            }();
            return TierArray(Take(std::move(r)));
          },
          pb::arg("keys"), pb::kw_only(), pb::arg("timeout_ms") = 60000)
      .def(
          "pull",
          [](PeerClient& c, const pb::handle& keys, const pb::handle& buffers, int timeout_ms) {
            auto k = ParseKeys(keys);
            Buffers b(buffers, true);
            if (b.size() != k.size()) ThrowIfError(InvalidArgument("pull: keys and buffers differ in number"));
            BufferSink sink(b.as_mutable());
            std::vector<uint8_t> received;
            Status st;
            {
              pb::gil_scoped_release nogil;  // the network transfer lands in the buffers
              st = c.Pull(k, sink, Deadline::After(std::chrono::milliseconds(timeout_ms)), received);
            }
            ThrowIfError(st);
            return Flags(received);
          },
          pb::arg("keys"), pb::arg("buffers"), pb::kw_only(), pb::arg("timeout_ms") = 120000)
      .def(
          "push",
          [](PeerClient& c, const pb::handle& keys, const pb::handle& buffers, int timeout_ms) {
            auto k = ParseKeys(keys);
            Buffers b(buffers, false);
            if (b.size() != k.size()) ThrowIfError(InvalidArgument("push: keys and buffers differ in number"));
            BufferSource source(b.as_const());
            std::vector<uint8_t> stored;
            Status st;
            {
              pb::gil_scoped_release nogil;
              st = c.Push(k, source, Deadline::After(std::chrono::milliseconds(timeout_ms)), stored);
            }
            ThrowIfError(st);
            return Flags(stored);
          },
          pb::arg("keys"), pb::arg("buffers"), pb::kw_only(), pb::arg("timeout_ms") = 120000)
      .def_property_readonly("block_bytes", &PeerClient::block_bytes)
      .def_property_readonly("address", &PeerClient::address);
}

}  // namespace tpusync::py
