#include "net/control_client.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string_view>

#include "base/copy.h"
#include "net/control_service.h"
#include "net/put_check.h"
#include "tpusync/net/block_stores.h"

namespace tpusync::net {

Result<std::unique_ptr<SidecarClient>> SidecarClient::Connect(const std::string& socket_path,
                                                              std::chrono::milliseconds timeout) {
  std::unique_ptr<SidecarClient> c(new SidecarClient());
  c->timeout_ = timeout;
  TPUSYNC_ASSIGN_OR_RETURN(c->socket_, Socket::ConnectUnix(socket_path, Deadline::After(timeout)));
  c->conn_ = std::make_unique<FramedConn>(c->socket_, 0);
  TPUSYNC_ASSIGN_OR_RETURN(Frame info, c->Call(Op::kInfo, {}, 0));
  BodyReader r(info.body);
  uint64_t slots = 0;
  if (info.header.op != Op::kInfoReply || !r.Str(&c->pool_path_, 4096) || !r.U64(&c->block_bytes_) ||
      !r.U64(&slots) || !r.done()) {
    return BadFrame("INFO reply");
  }
  c->batch_ = std::clamp<size_t>(slots / 4, 1, 1024);
  UniqueFd fd(::open(c->pool_path_.c_str(), O_RDWR | O_CLOEXEC));
  if (!fd.valid()) return ErrnoStatus(errno, "open the sidecar's pool file " + c->pool_path_);
  struct stat st {};
  ::fstat(fd.get(), &st);
  void* base = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (base == MAP_FAILED) return ErrnoStatus(errno, "map the sidecar's pool file " + c->pool_path_);
  c->pool_ = Mapping(base, static_cast<size_t>(st.st_size));
  return c;
}

void SidecarClient::Close() {
  std::lock_guard lock(mu_);
  if (!socket_.valid()) return;
  // Half-close, then wait for the sidecar to close its end: it does so only after it has
  // dropped this session's pins and leases, so they are gone when Close() returns.
  ::shutdown(socket_.fd(), SHUT_WR);
  Deadline d = Deadline::After(timeout_);
  std::byte b;
  while (socket_.ReadFull(&b, 1, d).ok()) {
  }
  socket_.Close();
}

Result<Frame> SidecarClient::Call(Op op, std::span<const std::byte> body, uint32_t count, uint16_t status,
                                  std::chrono::milliseconds wait) {
  if (!socket_.valid()) {
    return Status(StatusCode::kUnavailable, "the control channel is closed (by close(), or after an earlier failure)");
  }
  Deadline d = Deadline::After(timeout_ + wait);
  Status st = conn_->Send(op, body, d, count, status);
  Result<Frame> f = st.ok() ? conn_->Recv(d) : Result<Frame>(st);
  // A reply that did not arrive whole leaves the channel out of step: drop it.
  if (!f.ok() && (!st.ok() || !conn_->in_step())) socket_.Close();
  return f;
}

Result<Frame> SidecarClient::CallKeys(Op op, std::span<const BlockKey> keys, uint16_t status) {
  BodyWriter w;
  WriteKeyList(w, keys);
  return Call(op, w.bytes(), static_cast<uint32_t>(keys.size()), status);
}

Result<std::vector<SidecarClient::Slot>> SidecarClient::Slots(Op op, std::span<const BlockKey> keys) {
  TPUSYNC_ASSIGN_OR_RETURN(Frame f, CallKeys(op, keys));
  BodyReader r(f.body);
  std::vector<Slot> slots(keys.size());
  for (Slot& s : slots) {
    if (!r.U8(&s.code) || !r.U64(&s.offset) || !r.U64(&s.size)) break;
    if (s.code == kSlotOk && (s.offset + s.size > pool_.size() || s.size > block_bytes_)) {
      return BadFrame("slot outside the pool file");
    }
  }
  if (f.header.op != Op::kSlots || !r.done()) return BadFrame("SLOTS reply");
  return slots;
}

Status SidecarClient::Put(std::span<const BlockKey> keys, std::span<const ConstBuffer> buffers) {
  TPUSYNC_RETURN_IF_ERROR(CheckPutBuffers(keys, buffers, block_bytes_));
  std::lock_guard lock(mu_);
  for (size_t i = 0; i < keys.size(); i += batch_) {
    size_t n = std::min(batch_, keys.size() - i);
    TPUSYNC_RETURN_IF_ERROR(PutBatch(keys.subspan(i, n), buffers.subspan(i, n)));
  }
  return Status::Ok();
}

// Reserves, fills and commits one batch. The sidecar waits for another writer of a key, or
// for a slot, only while this connection holds no reservation; keys it answered busy or
// no-room are asked for again after the rest is committed, until a round makes no progress.
Status SidecarClient::PutBatch(std::span<const BlockKey> keys, std::span<const ConstBuffer> buffers) {
  std::vector<size_t> todo(keys.size());
  for (size_t i = 0; i < todo.size(); ++i) todo[i] = i;
  while (!todo.empty()) {
    std::vector<BlockKey> ask;
    ask.reserve(todo.size());
    for (size_t i : todo) ask.push_back(keys[i]);
    TPUSYNC_ASSIGN_OR_RETURN(std::vector<Slot> slots, Slots(Op::kReserve, ask));
    BodyWriter w;
    std::vector<BlockKey> done;
    std::vector<size_t> again;
    bool no_room = false;
    for (size_t j = 0; j < todo.size(); ++j) {
      const size_t i = todo[j];
      if (slots[j].code == kSlotNoRoom || slots[j].code == kSlotBusy) {
        no_room |= slots[j].code == kSlotNoRoom;
        again.push_back(i);
      } else if (slots[j].code == kSlotOk) {
        CopyBytes(pool_.data() + slots[j].offset, buffers[i].data, buffers[i].size);
        done.push_back(keys[i]);
      }
    }
    WriteKeyList(w, done);
    for (size_t j = 0; j < todo.size(); ++j) {
      if (slots[j].code == kSlotOk) w.U64(buffers[todo[j]].size);
    }
    TPUSYNC_RETURN_IF_ERROR(Call(Op::kCommit, w.bytes(), static_cast<uint32_t>(done.size())).status());
    if (again.size() == todo.size()) {  // the sidecar waited for the first of them and gave up
      if (no_room) return ResourceExhausted("put: the sidecar's DRAM is full of pinned or leased blocks");
      return Status(StatusCode::kUnavailable,
                    "put: block " + keys[again.front()].ToHex() + " is being written by another connection");
    }
    todo = std::move(again);
  }
  return Status::Ok();
}

Status SidecarClient::Get(std::span<const BlockKey> keys, std::span<const MutableBuffer> out,
                          std::span<uint8_t> found) {
  if (keys.size() != out.size() || keys.size() != found.size()) return InvalidArgument("get: sizes differ");
  std::lock_guard lock(mu_);
  Status result = Status::Ok();
  for (size_t i = 0; i < keys.size(); i += batch_) {
    size_t n = std::min(batch_, keys.size() - i);
    Status st = GetBatch(keys.subspan(i, n), out.subspan(i, n), found.subspan(i, n));
    if (st.code() != StatusCode::kInvalidArgument) TPUSYNC_RETURN_IF_ERROR(st);
    if (result.ok()) result = st;
  }
  return result;
}

Status SidecarClient::GetBatch(std::span<const BlockKey> keys, std::span<const MutableBuffer> out,
                               std::span<uint8_t> found) {
  TPUSYNC_ASSIGN_OR_RETURN(std::vector<Slot> slots, Slots(Op::kAcquire, keys));
  Status result = Status::Ok();
  std::vector<BlockKey> held;
  for (size_t i = 0; i < keys.size(); ++i) {
    found[i] = 0;
    if (slots[i].code != kSlotOk) continue;
    held.push_back(keys[i]);
    if (out[i].size < slots[i].size) {
      if (result.ok()) result = InvalidArgument("get: output buffer " + std::to_string(i) + " is too small");
      continue;
    }
    if (out[i].size != slots[i].size) continue;  // a shorter block is a miss: never a half-stale buffer
    CopyBytes(out[i].data, pool_.data() + slots[i].offset, slots[i].size);
    found[i] = 1;
  }
  TPUSYNC_RETURN_IF_ERROR(CallKeys(Op::kUnacquire, held).status());
  return result;
}

Result<LookupResult> SidecarClient::Lookup(std::span<const BlockKey> keys, bool pin_prefix) {
  std::lock_guard lock(mu_);
  TPUSYNC_ASSIGN_OR_RETURN(Frame f, CallKeys(Op::kLookup, keys, pin_prefix ? kLookupPin : 0));
  if (f.header.op != Op::kTiers || f.body.size() != keys.size()) return BadFrame("TIERS reply");
  LookupResult r;
  for (std::byte b : f.body) {
    auto t = std::to_integer<uint8_t>(b);
    r.tiers.push_back(TierFromCode(t));
  }
  while (r.prefix_len < r.tiers.size() && r.tiers[r.prefix_len] != Tier::kNone) ++r.prefix_len;
  return r;
}

Result<std::vector<Tier>> SidecarClient::Where(std::span<const BlockKey> keys) {
  std::lock_guard lock(mu_);
  TPUSYNC_ASSIGN_OR_RETURN(Frame f, CallKeys(Op::kLookup, keys, kLookupEveryKey));
  if (f.header.op != Op::kTiers || f.body.size() != keys.size()) return BadFrame("TIERS reply");
  std::vector<Tier> tiers;
  for (std::byte b : f.body) tiers.push_back(TierFromCode(std::to_integer<uint8_t>(b)));
  return tiers;
}

// Records go in batches small enough that every reply fits in one frame.
constexpr size_t kRecordsPerCall = kMaxBodyBytes / 2 / (kMaxRecordBytes + 20);

Status SidecarClient::Describe(std::span<const BlockKey> keys, std::span<const std::string> records) {
  if (keys.size() != records.size()) return InvalidArgument("describe: one record per key");
  std::lock_guard lock(mu_);
  for (size_t i = 0; i < keys.size(); i += kRecordsPerCall) {
    const size_t n = std::min(kRecordsPerCall, keys.size() - i);
    BodyWriter w;
    WriteKeyList(w, keys.subspan(i, n));
    for (size_t j = i; j < i + n; ++j) {
      if (records[j].empty() || records[j].size() > kMaxRecordBytes) {
        return InvalidArgument("describe: record " + std::to_string(j) + " of " + std::to_string(records[j].size()) +
                               " bytes is outside 1.." + std::to_string(kMaxRecordBytes));
      }
      w.Str(records[j]);
    }
    TPUSYNC_RETURN_IF_ERROR(Call(Op::kDescribe, w.bytes(), static_cast<uint32_t>(n)).status());
  }
  return Status::Ok();
}

Result<SharedRecords> SidecarClient::Records(std::span<const BlockKey> keys, size_t max_keys) {
  if (max_keys == 0 || max_keys > kMaxKeys) return InvalidArgument("records: max_keys must be 1.." + std::to_string(kMaxKeys));
  SharedRecords out;
  std::lock_guard lock(mu_);
  for (size_t i = 0; i == 0 || i < keys.size(); i += kRecordsPerCall) {
    const size_t n = std::min(kRecordsPerCall, keys.size() - i);
    BodyWriter w;
    WriteKeyList(w, keys.subspan(i, n));
    w.U32(static_cast<uint32_t>(max_keys));
    TPUSYNC_ASSIGN_OR_RETURN(Frame f, Call(Op::kRecords, w.bytes(), static_cast<uint32_t>(n)));
    BodyReader r(f.body);
    std::span<const std::byte> key_bytes;
    if (f.header.op != Op::kRecordsReply || (n != 0 && f.header.count != n) || f.header.count > max_keys ||
        !r.Bytes(uint64_t{f.header.count} * 16, &key_bytes)) {
      return BadFrame("RECORDS reply");
    }
    TPUSYNC_ASSIGN_OR_RETURN(std::vector<BlockKey> got, ParseKeyList(key_bytes, f.header.count));
    for (const BlockKey& k : got) {
      out.keys.push_back(k);
      if (!r.Str(&out.records.emplace_back(), kMaxRecordBytes)) return BadFrame("RECORDS reply");
    }
    if (!r.done()) return BadFrame("RECORDS reply");
    if (keys.empty()) break;
  }
  return out;
}

Status SidecarClient::Pin(std::span<const BlockKey> keys, bool for_host) {
  std::lock_guard lock(mu_);
  return CallKeys(Op::kPin, keys, for_host ? kPinForHost : 0).status();
}

Status SidecarClient::Release(std::span<const BlockKey> keys, bool for_host) {
  std::lock_guard lock(mu_);
  return CallKeys(Op::kRelease, keys, for_host ? kPinForHost : 0).status();
}

Status SidecarClient::Evict(std::span<const BlockKey> keys) {
  std::lock_guard lock(mu_);
  return CallKeys(Op::kEvict, keys).status();
}

Status SidecarClient::Flush() {
  std::lock_guard lock(mu_);
  return Call(Op::kFlush, {}, 0).status();
}

Result<ChangeBatch> SidecarClient::Changes(ChangeCursor since, std::chrono::milliseconds wait, size_t max_keys) {
  if (wait.count() < 0 || wait.count() > kMaxChangesWaitMs || max_keys == 0 || max_keys > kMaxKeys) {
    return InvalidArgument("changes: wait must be 0.." + std::to_string(kMaxChangesWaitMs) + " ms and max_keys 1.." +
                           std::to_string(kMaxKeys));
  }
  BodyWriter w;
  w.U64(since.epoch);
  w.U64(since.seq);
  w.U32(static_cast<uint32_t>(wait.count()));
  w.U32(static_cast<uint32_t>(max_keys));
  std::lock_guard lock(mu_);
  TPUSYNC_ASSIGN_OR_RETURN(Frame f, Call(Op::kChanges, w.bytes(), 0, 0, wait));
  BodyReader r(f.body);
  ChangeBatch b;
  std::span<const std::byte> keys;
  if (f.header.op != Op::kChangesReply || f.header.count > max_keys || !r.U64(&b.next.epoch) || !r.U64(&b.next.seq) ||
      !r.Bytes(uint64_t{f.header.count} * 16, &keys) || !r.done()) {
    return BadFrame("CHANGES reply");
  }
  TPUSYNC_ASSIGN_OR_RETURN(b.keys, ParseKeyList(keys, f.header.count));
  b.lost = f.header.status != 0;
  return b;
}

Result<StoreStats> SidecarClient::Stats() {
  std::lock_guard lock(mu_);
  TPUSYNC_ASSIGN_OR_RETURN(Frame f, Call(Op::kStats, {}, 0));
  if (f.header.op != Op::kStatsReply) return BadFrame("STATS reply");
  // "name value" lines (ControlService's StatsText); names this client does not know are
  // skipped, so an older client reads a newer sidecar.
  StoreStats s;
  std::map<std::string, uint64_t*> fields;
  for (const auto& [name, field] : kStoreCounters) fields[name] = &(s.*field);
  for (const auto& [name, field] : kSharedTierCounters) fields["shared_" + std::string(name)] = &(s.shared.*field);
  std::map<std::string, bool*> flags = {{"shared_direct_io", &s.shared.direct_io}};
  for (const auto& [name, field] : kStoreFlags) flags[name] = &(s.*field);
  std::istringstream in(std::string(reinterpret_cast<const char*>(f.body.data()), f.body.size()));
  std::string line;
  while (std::getline(in, line)) {
    const size_t space = line.find(' ');
    if (space == std::string::npos) continue;
    const std::string_view name = std::string_view(line).substr(0, space);
    const std::string value = line.substr(space + 1);
    if (name == "last_error") {
      s.last_error = value;
    } else if (auto it = fields.find(std::string(name)); it != fields.end()) {
      *it->second = std::strtoull(value.c_str(), nullptr, 10);
    } else if (auto fl = flags.find(std::string(name)); fl != flags.end()) {
      *fl->second = value == "1";
    }
  }
  return s;
}

Result<std::vector<uint8_t>> SidecarClient::PeerCall(Op op, const std::string& peer, std::span<const BlockKey> keys,
                                                     std::vector<uint64_t>* digests) {
  BodyWriter w;
  w.Str(peer);
  WriteKeyList(w, keys);
  std::lock_guard lock(mu_);
  TPUSYNC_ASSIGN_OR_RETURN(Frame f, Call(op, w.bytes(), static_cast<uint32_t>(keys.size()),
                                          digests != nullptr ? kWantDigests : 0));
  // The per-key bytes, the digests if asked for, and after a failure the error.
  const bool failed = f.header.status != 0;
  const size_t fixed = keys.size() * (digests != nullptr ? 9 : 1);
  if (f.header.op != Op::kTiers || f.body.size() < fixed || (!failed && f.body.size() != fixed) ||
      f.body.size() > fixed + kMaxErrorBytes) {
    return BadFrame("peer reply");
  }
  std::vector<uint8_t> out(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) out[i] = std::to_integer<uint8_t>(f.body[i]);
  if (digests != nullptr) {
    BodyReader r(std::span(f.body).subspan(keys.size(), keys.size() * 8));
    digests->assign(keys.size(), 0);
    for (uint64_t& v : *digests) r.U64(&v);
  }
  if (failed) {  // what arrived before the failure is kept
    auto code = static_cast<StatusCode>(std::min<uint16_t>(f.header.status, static_cast<uint16_t>(StatusCode::kInternal)));
    if (code == StatusCode::kOk) code = StatusCode::kInternal;
    size_t held = static_cast<size_t>(std::count_if(out.begin(), out.end(), [](uint8_t v) { return v != 0; }));
    std::string why(reinterpret_cast<const char*>(f.body.data()) + fixed, f.body.size() - fixed);
    return Status(code, why + " (" + std::to_string(held) + " of " + std::to_string(keys.size()) +
                            " blocks held locally)");
  }
  return out;
}

Result<PullReport> SidecarClient::PullFrom(const std::string& peer, std::span<const BlockKey> keys, bool digests) {
  PullReport report;
  TPUSYNC_ASSIGN_OR_RETURN(report.held, PeerCall(Op::kPullFrom, peer, keys, digests ? &report.digests : nullptr));
  if (!digests) report.digests.assign(keys.size(), 0);
  return report;
}

Result<std::vector<uint8_t>> SidecarClient::PushTo(const std::string& peer, std::span<const BlockKey> keys) {
  return PeerCall(Op::kPushTo, peer, keys);
}

Result<std::vector<Tier>> SidecarClient::ExistsAt(const std::string& peer, std::span<const BlockKey> keys) {
  TPUSYNC_ASSIGN_OR_RETURN(std::vector<uint8_t> codes, PeerCall(Op::kExistsAt, peer, keys));
  std::vector<Tier> tiers(codes.size());
  for (size_t i = 0; i < codes.size(); ++i) tiers[i] = TierFromCode(codes[i]);
  return tiers;
}

}  // namespace tpusync::net

namespace tpusync::net {

Result<std::vector<BlockSlot>> SidecarClient::Views(Op op, std::span<const BlockKey> keys,
                                                   std::vector<uint8_t>& codes) {
  std::lock_guard lock(mu_);
  TPUSYNC_ASSIGN_OR_RETURN(std::vector<Slot> slots, Slots(op, keys));
  std::vector<BlockSlot> views(slots.size());
  codes.resize(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    codes[i] = slots[i].code;
    if (slots[i].code == kSlotOk) views[i] = {pool_.data() + slots[i].offset, slots[i].size, slots[i].offset};
  }
  return views;
}

Result<std::vector<BlockSlot>> SidecarClient::Reserve(std::span<const BlockKey> keys) {
  std::vector<uint8_t> codes;
  TPUSYNC_ASSIGN_OR_RETURN(std::vector<BlockSlot> views, Views(Op::kReserve, keys, codes));
  std::vector<BlockKey> reserved;
  bool no_room = false, busy = false;
  for (size_t i = 0; i < views.size(); ++i) {
    if (views[i].data != nullptr) reserved.push_back(keys[i]);
    no_room |= codes[i] == kSlotNoRoom;
    busy |= codes[i] == kSlotBusy;
  }
  if (!no_room && !busy) return views;
  TPUSYNC_RETURN_IF_ERROR(Abort(reserved));  // all or nothing: give back what was reserved
  if (no_room) return ResourceExhausted("reserve: the sidecar has no free slot for every block");
  return Status(StatusCode::kUnavailable, "reserve: another connection is writing one of these blocks");
}

Result<std::vector<BlockSlot>> SidecarClient::Acquire(std::span<const BlockKey> keys) {
  std::vector<uint8_t> codes;
  return Views(Op::kAcquire, keys, codes);
}

Status SidecarClient::Commit(std::span<const BlockKey> keys, std::span<const uint64_t> lengths) {
  if (keys.size() != lengths.size()) return InvalidArgument("commit: keys and lengths differ in number");
  BodyWriter w;
  WriteKeyList(w, keys);
  for (uint64_t len : lengths) w.U64(len);
  std::lock_guard lock(mu_);
  return Call(Op::kCommit, w.bytes(), static_cast<uint32_t>(keys.size())).status();
}

Status SidecarClient::Abort(std::span<const BlockKey> keys) {
  std::lock_guard lock(mu_);
  return CallKeys(Op::kAbort, keys).status();
}

Status SidecarClient::Unacquire(std::span<const BlockKey> keys) {
  std::lock_guard lock(mu_);
  return CallKeys(Op::kUnacquire, keys).status();
}

Result<std::unique_ptr<BlockStore>> ConnectSidecar(const std::string& socket_path, std::chrono::milliseconds timeout) {
  TPUSYNC_ASSIGN_OR_RETURN(std::unique_ptr<SidecarClient> c, SidecarClient::Connect(socket_path, timeout));
  return std::unique_ptr<BlockStore>(std::move(c));
}

}  // namespace tpusync::net
