#include "net/peer_service.h"

#include <optional>
#include <unordered_set>

#include "base/log.h"

namespace tpusync::net {
namespace {

std::span<const std::byte> AsBytes(const std::vector<Tier>& tiers) {
  return std::as_bytes(std::span(tiers.data(), tiers.size()));
}

constexpr Op kDataOps[] = {Op::kExists, Op::kPull, Op::kPush};

// Marks the repeats of a key within one request: each block moves once per request, so a
// request naming one block many times cannot multiply what the sidecar sends.
std::vector<uint8_t> Repeats(std::span<const BlockKey> keys) {
  std::vector<uint8_t> repeat(keys.size());
  std::unordered_set<BlockKey, BlockKeyHash> seen;
  for (size_t i = 0; i < keys.size(); ++i) repeat[i] = !seen.insert(keys[i]).second;
  return repeat;
}

}  // namespace

void PeerService::LogRefused(const std::string& source, const Status& why) {
  constexpr auto kInterval = std::chrono::seconds(10);
  std::lock_guard lock(log_mu_);
  if (refusals_.size() > 4096) refusals_.clear();  // bounded, whatever the number of sources
  RefusalLog& r = refusals_[source];
  const auto now = Clock::now();
  if (r.last != Clock::time_point() && now - r.last < kInterval) {
    ++r.skipped;
    return;
  }
  std::string skipped = r.skipped ? " (" + std::to_string(r.skipped) + " more from this source not logged)" : "";
  r = {now, 0};
  Log(LogLevel::kWarning, "data", "handshake from " + source + " refused: " + why.ToString() + skipped);
}

void PeerService::Serve(Connection& conn) {
  ++metrics_.connections_total;
  ++metrics_.connections_active;
  const WakeFd& stop = conn.stop();
  FramedConn c(conn.socket(), store_.block_bytes());
  const Deadline hd = Deadline::After(options_.handshake_timeout);
  Status hs = ServerHandshake(c, secret_, {.block_bytes = store_.block_bytes(), .encrypt = options_.encrypt},
                              hd, [&conn] { return conn.Admit(); });
  c.set_progress_timeout(options_.progress_timeout);
  if (hs.code() == StatusCode::kResourceExhausted) {
    (void)c.SendError(ResourceExhausted("data: " + hs.message()), hd);
  } else if (hs.code() == StatusCode::kFailedPrecondition) {
    (void)c.SendError(hs, hd);  // a member configured differently (block size): say so
    LogRefused(conn.source(), hs);
  } else if (!hs.ok()) {
    if (hs.code() == StatusCode::kUnauthenticated || hs.code() == StatusCode::kMalformed ||
        hs.code() == StatusCode::kInvalidArgument) {
      ++metrics_.auth_failures;  // counted before the reply, so a refused peer already sees it in /metrics
      (void)c.SendError(hs, hd);
    }
    LogRefused(conn.source(), hs);
  } else {
    for (;;) {
      Result<bool> readable = c.WaitReadable(stop.fd(), Deadline::After(options_.idle_timeout));
      if (!readable.ok() || !*readable) break;  // idle too long, or draining
      Deadline d = Deadline::After(options_.op_timeout);
      auto start = Clock::now();
      Result<Frame> f = c.RecvKeyRequest(kDataOps, d);
      if (!f.ok()) {
        if (f.status().code() == StatusCode::kMalformed) {
          ++metrics_.bad_frames;
          (void)c.SendError(f.status(), d);
          Log(LogLevel::kWarning, "data", "connection closed: " + f.status().message());
        }
        break;
      }
      ServerOp op = ServerOp::kControl;
      Status st;
      switch (f->header.op) {
        case Op::kExists: op = ServerOp::kExists, st = HandleExists(c, *f, d); break;
        case Op::kPull: op = ServerOp::kPull, st = HandlePull(c, *f, d); break;
        default: op = ServerOp::kPush, st = HandlePush(c, *f, d); break;  // RecvKeyRequest admits only these
      }
      metrics_.Latency(op, std::chrono::duration<double>(Clock::now() - start).count());
      if (!st.ok()) {
        metrics_.Error(op);
        if (st.code() == StatusCode::kMalformed) ++metrics_.bad_frames;
        if (st.code() == StatusCode::kDeadlineExceeded) ++metrics_.deadline_exceeded;
        // Told why, briefly: a peer that stopped reading must not hold this thread again.
        if (st.code() != StatusCode::kUnavailable) {
          (void)c.SendError(st, Deadline::Earliest(d, Deadline::After(std::chrono::milliseconds(200))));
        }
        Log(LogLevel::kWarning, "data", "request failed, connection closed: " + st.ToString());
        break;
      }
    }
  }
  --metrics_.connections_active;
}

Status PeerService::HandleExists(FramedConn& c, const Frame& f, Deadline d) {
  TPUSYNC_ASSIGN_OR_RETURN(auto keys, ParseKeyList(f.body, f.header.count));
  LookupResult r = store_.Lookup(keys, false);
  return c.Send(Op::kTiers, AsBytes(r.tiers), d, static_cast<uint32_t>(keys.size()));
}

// Streams every requested block in order, one frame each, straight from its slot, so the
// receiver can start on the first (layers) before the last arrive.
Status PeerService::HandlePull(FramedConn& c, const Frame& f, Deadline d) {
  TPUSYNC_ASSIGN_OR_RETURN(auto keys, ParseKeyList(f.body, f.header.count));
  LookupResult r = store_.Lookup(keys, false);
  std::vector<uint8_t> repeat = Repeats(keys);
  for (size_t i = 0; i < keys.size(); ++i) {
    if (repeat[i]) r.tiers[i] = Tier::kNone;  // announced absent: sent once, at its first index
  }
  TPUSYNC_RETURN_IF_ERROR(c.Send(Op::kTiers, AsBytes(r.tiers), d, static_cast<uint32_t>(keys.size())));
  for (uint32_t i = 0; i < keys.size(); ++i) {
    if (r.tiers[i] == Tier::kNone) continue;
    Result<ReadLease> lease = store_.Acquire(keys[i]);  // promotes from disk if needed
    if (!lease.ok()) {
      TPUSYNC_RETURN_IF_ERROR(c.SendAbsent(i, d));  // evicted or corrupt since the lookup
      continue;
    }
    TPUSYNC_RETURN_IF_ERROR(c.SendBlock(i, lease->data(), lease->size(), d));
    metrics_.Moved(Direction::kOut, TransferOp::kPull, r.tiers[i] == Tier::kDisk ? Tier::kDisk : Tier::kDram,
                   lease->size());
  }
  return c.Send(Op::kEnd, {}, d);
}

// Tells the pusher which blocks are wanted (prefix-aware: held ones are skipped), receives
// each straight into a reserved slot, and commits it only after its tag matched. A slot is
// reserved only once the payload starts to arrive, and without waiting for another writer of
// the key (that wait could outlast the pusher's progress deadline): a key another writer holds
// is drained and counts as stored if that writer committed by the end.
Status PeerService::HandlePush(FramedConn& c, const Frame& f, Deadline d) {
  TPUSYNC_ASSIGN_OR_RETURN(auto keys, ParseKeyList(f.body, f.header.count));
  LookupResult r = store_.Lookup(keys, false);
  std::vector<uint8_t> repeat = Repeats(keys);
  std::vector<uint8_t> wanted(keys.size()), stored(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) wanted[i] = r.tiers[i] == Tier::kNone && !repeat[i];
  TPUSYNC_RETURN_IF_ERROR(c.Send(Op::kTiers, std::as_bytes(std::span(wanted)), d, static_cast<uint32_t>(keys.size())));
  for (;;) {
    TPUSYNC_ASSIGN_OR_RETURN(FrameHeader h, c.RecvBlockHeader(d));
    if (h.op == Op::kEnd) break;
    if (h.count >= keys.size() || !wanted[h.count]) {
      return BadFrame("BLOCK index " + std::to_string(h.count) + " was not asked for");
    }
    wanted[h.count] = 0;  // each index at most once
    if (h.status != 0) continue;
    TPUSYNC_RETURN_IF_ERROR(c.AwaitPayload(d));
    std::optional<WriteLease> lease;
    if (auto l = store_.Reserve(keys[h.count], /*wait=*/false); l.ok()) lease.emplace(std::move(l).value());
    // A slot that cannot be had (DRAM full of pins, or stored meanwhile): drain the payload.
    TPUSYNC_RETURN_IF_ERROR(c.RecvBlockPayload(lease ? lease->data() : nullptr, h.body_len, d));
    if (lease) {
      TPUSYNC_RETURN_IF_ERROR(lease->Commit(h.body_len));
      stored[h.count] = 1;
      metrics_.Moved(Direction::kIn, TransferOp::kPush, Tier::kDram, h.body_len);
    }
  }
  // Stored means readable now: written here, held before, or committed by another writer.
  LookupResult after = store_.Lookup(keys, false);
  for (size_t i = 0; i < keys.size(); ++i) stored[i] |= after.tiers[i] != Tier::kNone;
  return c.Send(Op::kPushDone, std::as_bytes(std::span(stored)), d, static_cast<uint32_t>(keys.size()));
}

}  // namespace tpusync::net
