#include "net/control_service.h"

#include <algorithm>
#include <map>
#include <sstream>

#include "base/log.h"

namespace tpusync::net {
namespace {

Status SendOk(FramedConn& c, Deadline d) { return c.Send(Op::kOk, {}, d); }

Result<std::vector<BlockKey>> Keys(const Frame& f) { return ParseKeyList(f.body, f.header.count); }

std::string StatsText(const StoreStats& s) {
  std::ostringstream o;
  for (const auto& [name, field] : kStoreCounters) o << name << " " << s.*field << "\n";
  for (const auto& [name, field] : kStoreFlags) o << name << " " << s.*field << "\n";
  o << "shared_direct_io " << s.shared.direct_io << "\n";
  for (const auto& [name, field] : kSharedTierCounters) o << "shared_" << name << " " << s.shared.*field << "\n";
  // Last, and on one line: the rest of the line is the message.
  std::string error = s.last_error;
  std::replace_if(error.begin(), error.end(), [](char ch) { return ch == '\n' || ch == '\r'; }, ' ');
  o << "last_error " << error << "\n";
  return o.str();
}

}  // namespace

bool KeyLess(const BlockKey& a, const BlockKey& b) { return a.hi != b.hi ? a.hi < b.hi : a.lo < b.lo; }

namespace {

using PinCounts = std::map<BlockKey, uint32_t, bool (*)(const BlockKey&, const BlockKey&)>;

// Releases pins only from `held` (what one holder took), all or none, so no holder can
// release another's pins.
Status ReleaseHeld(Store& store, PinCounts& held, std::span<const BlockKey> keys, const std::string& holder) {
  PinCounts want(&KeyLess);
  for (const BlockKey& k : keys) {
    auto it = held.find(k);
    if (it == held.end() || ++want[k] > it->second) {
      return FailedPrecondition("release: block " + k.ToHex() + " is not pinned by " + holder);
    }
  }
  TPUSYNC_RETURN_IF_ERROR(store.Release(keys));
  for (const auto& [k, n] : want) {
    if ((held[k] -= n) == 0) held.erase(k);
  }
  return Status::Ok();
}

}  // namespace

Status ControlService::PinForHost(std::span<const BlockKey> keys) {
  std::lock_guard lock(host_mu_);
  TPUSYNC_RETURN_IF_ERROR(store_.Pin(keys));
  for (const BlockKey& k : keys) ++host_pins_[k];
  return Status::Ok();
}

Status ControlService::ReleaseForHost(std::span<const BlockKey> keys) {
  std::lock_guard lock(host_mu_);
  return ReleaseHeld(store_, host_pins_, keys, "the host");
}

// Leases and pins taken by one engine connection; released when it disconnects, so an
// engine that crashes cannot keep blocks in DRAM forever.
struct ControlService::Session {
  explicit Session(Store& store) : store(store) {}
  ~Session() {
    std::vector<BlockKey> keys;
    for (const auto& [k, n] : pins) keys.insert(keys.end(), n, k);
    if (!keys.empty()) (void)store.Release(keys);
  }
  void Pinned(std::span<const BlockKey> keys) {
    for (const BlockKey& k : keys) ++pins[k];
  }
  Status Unpin(std::span<const BlockKey> keys) { return ReleaseHeld(store, pins, keys, "this connection"); }

  Store& store;
  std::map<BlockKey, WriteLease, decltype(&KeyLess)> reserved{&KeyLess};
  std::multimap<BlockKey, ReadLease, decltype(&KeyLess)> acquired{&KeyLess};
  PinCounts pins{&KeyLess};
};

void ControlService::Serve(Connection& conn) {
  if (Status admitted = conn.Admit(); !admitted.ok()) {
    RefuseWithErrorFrame(conn.socket(), "control: " + admitted.message());
    return;
  }
  const WakeFd& stop = conn.stop();
  FramedConn c(conn.socket(), store_.block_bytes());
  Session session(store_);
  for (;;) {
    Result<bool> readable = c.WaitReadable(stop.fd(), Deadline::Never());
    if (!readable.ok() || !*readable) break;
    Deadline d = Deadline::After(op_timeout_);
    auto start = Clock::now();
    Result<Frame> f = c.Recv(d);
    if (!f.ok()) {
      if (f.status().code() == StatusCode::kMalformed) {
        ++metrics_.bad_frames;
        (void)c.SendError(f.status(), d);
      }
      break;
    }
    Request request{c, *f, session, d, stop};
    const Handler handler = HandlerFor(f->header.op);
    Status st = handler != nullptr
                    ? (this->*handler)(request)
                    : BadFrame("op " + std::to_string(static_cast<int>(f->header.op)) + " is not a control request");
    metrics_.Latency(ServerOp::kControl, std::chrono::duration<double>(Clock::now() - start).count());
    if (!st.ok()) {
      metrics_.Error(ServerOp::kControl);
      if (st.code() == StatusCode::kMalformed) {
        ++metrics_.bad_frames;
        (void)c.SendError(st, d);
        break;  // malformed input closes the channel
      }
      if (!c.SendError(st, d).ok()) break;
    }
  }
}

ControlService::Handler ControlService::HandlerFor(Op op) {
  static constexpr std::pair<Op, Handler> kHandlers[] = {
      {Op::kInfo, &ControlService::Info},         {Op::kLookup, &ControlService::Lookup},
      {Op::kPin, &ControlService::Pin},           {Op::kRelease, &ControlService::Release},
      {Op::kEvict, &ControlService::Evict},       {Op::kFlush, &ControlService::Flush},
      {Op::kStats, &ControlService::Stats},       {Op::kReserve, &ControlService::Reserve},
      {Op::kCommit, &ControlService::Commit},     {Op::kAbort, &ControlService::Abort},
      {Op::kAcquire, &ControlService::Acquire},   {Op::kUnacquire, &ControlService::Unacquire},
      {Op::kChanges, &ControlService::Changes},   {Op::kDescribe, &ControlService::Describe},
      {Op::kRecords, &ControlService::Records},   {Op::kPullFrom, &ControlService::PeerOp},
      {Op::kPushTo, &ControlService::PeerOp},     {Op::kExistsAt, &ControlService::PeerOp},
  };
  for (const auto& [o, h] : kHandlers) {
    if (o == op) return h;
  }
  return nullptr;
}

Status ControlService::Info(Request& r) {
  BodyWriter w;
  w.Str(store_.pool_path());
  w.U64(store_.block_bytes());
  w.U64(store_.num_slots());
  return r.c.Send(Op::kInfoReply, w.bytes(), r.d);
}

Status ControlService::Lookup(Request& r) {
  TPUSYNC_ASSIGN_OR_RETURN(auto keys, Keys(r.f));
  if (r.f.header.status == kLookupEveryKey) {
    std::vector<Tier> tiers = store_.Where(keys);
    return r.c.Send(Op::kTiers, std::as_bytes(std::span(tiers)), r.d, static_cast<uint32_t>(keys.size()));
  }
  if (r.f.header.status > kLookupPin) return BadFrame("LOOKUP flags " + std::to_string(r.f.header.status));
  bool pin = r.f.header.status == kLookupPin;
  LookupResult found = store_.Lookup(keys, pin);
  if (pin) r.session.Pinned(std::span(keys).first(found.prefix_len));
  return r.c.Send(Op::kTiers, std::as_bytes(std::span(found.tiers)), r.d, static_cast<uint32_t>(keys.size()));
}

Status ControlService::Pin(Request& r) {
  TPUSYNC_ASSIGN_OR_RETURN(auto keys, Keys(r.f));
  if (r.f.header.status & kPinForHost) {
    TPUSYNC_RETURN_IF_ERROR(PinForHost(keys));
  } else {
    TPUSYNC_RETURN_IF_ERROR(store_.Pin(keys));
    r.session.Pinned(keys);
  }
  return SendOk(r.c, r.d);
}

Status ControlService::Release(Request& r) {
  TPUSYNC_ASSIGN_OR_RETURN(auto keys, Keys(r.f));
  TPUSYNC_RETURN_IF_ERROR(r.f.header.status & kPinForHost ? ReleaseForHost(keys) : r.session.Unpin(keys));
  return SendOk(r.c, r.d);
}

Status ControlService::Evict(Request& r) {
  TPUSYNC_ASSIGN_OR_RETURN(auto keys, Keys(r.f));
  TPUSYNC_RETURN_IF_ERROR(store_.Evict(keys));
  return SendOk(r.c, r.d);
}

Status ControlService::Flush(Request& r) {
  TPUSYNC_RETURN_IF_ERROR(store_.Flush());
  return SendOk(r.c, r.d);
}

Status ControlService::Stats(Request& r) {
  std::string text = StatsText(store_.Stats());
  return r.c.Send(Op::kStatsReply, std::as_bytes(std::span(text)), r.d);
}

Status ControlService::Reserve(Request& r) {
  TPUSYNC_ASSIGN_OR_RETURN(auto keys, Keys(r.f));
  BodyWriter w;
  std::vector<BlockKey> taken;  // by this request: given back if it fails
  for (const BlockKey& k : keys) {
    // A connection that holds reservations never waits for others' (no hold-and-wait, so
    // two engines filling the pool cannot deadlock): it gets kSlotBusy or kSlotNoRoom and
    // asks again after committing what it holds.
    Result<WriteLease> l = r.session.reserved.count(k) ? Result<WriteLease>(FailedPrecondition("reserved"))
                                                       : store_.Reserve(k, r.session.reserved.empty());
    const StatusCode sc = l.status().code();
    if (sc != StatusCode::kOk && sc != StatusCode::kFailedPrecondition && sc != StatusCode::kResourceExhausted &&
        sc != StatusCode::kUnavailable) {
      for (const BlockKey& t : taken) r.session.reserved.erase(t);
      return l.status();  // what it is, never "already stored" (Store::Reserve has no other code today)
    }
    uint8_t code = l.ok()                                 ? kSlotOk
                   : sc == StatusCode::kResourceExhausted ? kSlotNoRoom
                   : sc == StatusCode::kUnavailable       ? kSlotBusy
                                                          : kSlotAlreadyStored;
    w.U8(code);
    w.U64(l.ok() ? l->file_offset() : 0);
    w.U64(l.ok() ? l->capacity() : 0);
    if (l.ok()) {
      r.session.reserved.emplace(k, std::move(l).value());
      taken.push_back(k);
    }
  }
  return r.c.Send(Op::kSlots, w.bytes(), r.d, static_cast<uint32_t>(keys.size()));
}

Status ControlService::Commit(Request& r) {
  if (r.f.body.size() != uint64_t{r.f.header.count} * 24) return BadFrame("COMMIT body");
  BodyReader in(r.f.body);
  std::vector<std::pair<BlockKey, uint64_t>> items(r.f.header.count);
  for (auto& [k, len] : items) {
    if (!in.Key(&k)) break;
  }
  for (auto& [k, len] : items) {
    if (!in.U64(&len)) break;
  }
  if (!in.done()) return BadFrame("COMMIT body");
  for (auto& [k, len] : items) {
    auto it = r.session.reserved.find(k);
    if (it == r.session.reserved.end()) return FailedPrecondition("commit: block " + k.ToHex() + " was not reserved");
    Status st = it->second.Commit(len);
    r.session.reserved.erase(it);
    TPUSYNC_RETURN_IF_ERROR(st);
  }
  return SendOk(r.c, r.d);
}

Status ControlService::Abort(Request& r) {
  TPUSYNC_ASSIGN_OR_RETURN(auto keys, Keys(r.f));
  for (const BlockKey& k : keys) r.session.reserved.erase(k);
  return SendOk(r.c, r.d);
}

Status ControlService::Acquire(Request& r) {
  TPUSYNC_ASSIGN_OR_RETURN(auto keys, Keys(r.f));
  BodyWriter w;
  for (const BlockKey& k : keys) {
    Result<ReadLease> l = store_.Acquire(k);
    w.U8(l.ok() ? kSlotOk : kSlotMissing);
    w.U64(l.ok() ? l->file_offset() : 0);
    w.U64(l.ok() ? l->size() : 0);
    if (l.ok()) r.session.acquired.emplace(k, std::move(l).value());
  }
  return r.c.Send(Op::kSlots, w.bytes(), r.d, static_cast<uint32_t>(keys.size()));
}

Status ControlService::Unacquire(Request& r) {
  TPUSYNC_ASSIGN_OR_RETURN(auto keys, Keys(r.f));
  for (const BlockKey& k : keys) {
    if (auto it = r.session.acquired.find(k); it != r.session.acquired.end()) r.session.acquired.erase(it);
  }
  return SendOk(r.c, r.d);
}

// Waits in short slices, so that a stopping sidecar or a client that hung up (or sent
// something: it must not, mid-poll) ends the poll; the reply's deadline starts when it ends.
Status ControlService::Changes(Request& r) {
  BodyReader in(r.f.body);
  ChangeCursor since;
  uint32_t wait_ms = 0, max_keys = 0;
  if (!in.U64(&since.epoch) || !in.U64(&since.seq) || !in.U32(&wait_ms) || !in.U32(&max_keys) || !in.done() ||
      max_keys == 0 || max_keys > kMaxKeys || wait_ms > kMaxChangesWaitMs) {
    return BadFrame("CHANGES body");
  }
  constexpr auto kSlice = std::chrono::milliseconds(100);
  const auto until = Clock::now() + std::chrono::milliseconds(wait_ms);
  ChangeBatch b;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
    b = store_.Changes(since, std::clamp(left, std::chrono::milliseconds(0), kSlice), max_keys);
    if (b.lost || !b.keys.empty() || left <= kSlice) break;
    Result<bool> input = r.c.WaitReadable(r.stop.fd(), Deadline::After(std::chrono::milliseconds(0)));
    if (input.ok()) break;  // the client's input or hang-up (true), or the sidecar stopping (false)
  }
  BodyWriter w;
  w.U64(b.next.epoch);
  w.U64(b.next.seq);
  WriteKeyList(w, b.keys);
  return r.c.Send(Op::kChangesReply, w.bytes(), Deadline::After(op_timeout_), static_cast<uint32_t>(b.keys.size()),
                b.lost ? 1 : 0);
}

// Body: the keys, then a record per key.
Status ControlService::Describe(Request& r) {
  BodyReader in(r.f.body);
  std::span<const std::byte> key_bytes;
  if (!in.Bytes(uint64_t{r.f.header.count} * 16, &key_bytes)) return BadFrame("DESCRIBE body");
  TPUSYNC_ASSIGN_OR_RETURN(auto keys, ParseKeyList(key_bytes, r.f.header.count));
  std::vector<std::string> records(keys.size());
  for (std::string& record : records) {
    if (!in.Str(&record, kMaxRecordBytes)) return BadFrame("DESCRIBE body");
  }
  if (!in.done()) return BadFrame("DESCRIBE body");
  TPUSYNC_RETURN_IF_ERROR(store_.Describe(keys, records));
  return SendOk(r.c, r.d);
}

// Body: the keys (none: the catalog), then max keys. The reply holds as many records as fit
// in a frame; a client asking by key sends few enough that all do.
Status ControlService::Records(Request& r) {
  BodyReader in(r.f.body);
  std::span<const std::byte> key_bytes;
  uint32_t max_keys = 0;
  if (!in.Bytes(uint64_t{r.f.header.count} * 16, &key_bytes) || !in.U32(&max_keys) || !in.done() || max_keys == 0 ||
      max_keys > kMaxKeys) {
    return BadFrame("RECORDS body");
  }
  TPUSYNC_ASSIGN_OR_RETURN(auto keys, ParseKeyList(key_bytes, r.f.header.count));
  TPUSYNC_ASSIGN_OR_RETURN(SharedRecords got, store_.Records(keys, max_keys));
  size_t n = 0, bytes = 0;
  while (n < got.keys.size() && bytes + 20 + got.records[n].size() <= kMaxBodyBytes) bytes += 20 + got.records[n++].size();
  BodyWriter w;
  WriteKeyList(w, std::span(got.keys).first(n));
  for (size_t i = 0; i < n; ++i) w.Str(got.records[i]);
  return r.c.Send(Op::kRecordsReply, w.bytes(), r.d, static_cast<uint32_t>(n));
}

// Body: peer address, then the keys.
Status ControlService::PeerOp(Request& r) {
  BodyReader in(r.f.body);
  std::string peer;
  std::span<const std::byte> key_bytes;
  if (!in.Str(&peer, 512) || !in.Bytes(uint64_t{r.f.header.count} * 16, &key_bytes) || !in.done()) {
    return BadFrame("peer request body");
  }
  TPUSYNC_ASSIGN_OR_RETURN(auto keys, ParseKeyList(key_bytes, r.f.header.count));
  // Only the pool's members are dialled (PoolMembers): no engine request reaches another host.
  TPUSYNC_ASSIGN_OR_RETURN(std::shared_ptr<PeerClient> client, peers_.Get(peer));
  std::vector<uint8_t> result;
  std::vector<uint64_t> digests;
  Status st;
  if (r.f.header.op == Op::kExistsAt) {
    Result<std::vector<Tier>> tiers = client->Exists(keys, r.d);
    st = tiers.status();
    if (tiers.ok()) {
      for (Tier t : *tiers) result.push_back(static_cast<uint8_t>(t));
    }
  } else if (r.f.header.op == Op::kPullFrom) {
    PullResult pulled;
    st = PullIntoStore(*client, store_, keys, r.d, pulled, (r.f.header.status & kWantDigests) != 0);
    metrics_.Moved(Direction::kIn, TransferOp::kPull, Tier::kDram, pulled.bytes, pulled.blocks);
    result = std::move(pulled.held);
    if (r.f.header.status & kWantDigests) digests = std::move(pulled.digests);
  } else {
    st = PushFromStore(*client, store_, keys, r.d, result);
  }
  if (!st.ok()) {
    // A dead or misbehaving peer: report which blocks made it, and reconnect next time.
    peers_.Forget(client->address());
    Log(LogLevel::kWarning, "control", "peer " + peer + ": " + st.ToString());
    if (result.size() != keys.size()) return st;
  }
  BodyWriter body;
  body.Bytes(std::as_bytes(std::span(result)));
  for (uint64_t v : digests) body.U64(v);
  if (!st.ok()) {  // the error follows the per-key bytes, so the caller learns both
    std::string why = ("peer " + peer + ": " + st.message()).substr(0, kMaxErrorBytes);
    body.Bytes(std::as_bytes(std::span(why)));
  }
  return r.c.Send(Op::kTiers, body.bytes(), r.d, static_cast<uint32_t>(keys.size()),
                st.ok() ? 0 : static_cast<uint16_t>(st.code()));
}

}  // namespace tpusync::net
