#include "net/peer_client.h"

#include <thread>

namespace tpusync::net {

struct PeerClient::Stream {
  std::mutex mu;  // one request at a time per stream
  Socket socket;
  std::unique_ptr<FramedConn> conn;  // null when disconnected
};

PeerClient::~PeerClient() = default;

Result<std::unique_ptr<PeerClient>> PeerClient::Connect(const std::string& address, Secret secret,
                                                        PeerClientOptions options) {
  if (options.streams < 1 || options.streams > 64) return InvalidArgument("streams must be 1..64");
  TPUSYNC_ASSIGN_OR_RETURN(auto hp, SplitHostPort(address));
  std::unique_ptr<PeerClient> c(new PeerClient());
  c->address_ = address;
  c->host_ = hp.first;
  c->port_ = hp.second;
  c->secret_.emplace(std::move(secret));
  c->options_ = options;
  for (int i = 0; i < options.streams; ++i) c->streams_.push_back(std::make_unique<Stream>());
  for (auto& s : c->streams_) {
    std::lock_guard lock(s->mu);
    TPUSYNC_RETURN_IF_ERROR(c->Connected(*s, Deadline::After(options.connect_timeout)));
  }
  return c;
}

Status PeerClient::Connected(Stream& s, Deadline d) {
  if (s.conn) return Status::Ok();
  Deadline connect = Deadline::Earliest(d, Deadline::After(options_.connect_timeout));
  TPUSYNC_ASSIGN_OR_RETURN(s.socket, Socket::ConnectTcp(host_, port_, connect));
  auto conn = std::make_unique<FramedConn>(s.socket, 0);
  Result<uint64_t> bb =
      ClientHandshake(*conn, *secret_, {.block_bytes = options_.block_bytes, .encrypt = options_.encrypt}, connect);
  if (!bb.ok()) {
    s.socket.Close();
    return Status(bb.status().code(), address_ + ": " + bb.status().message());
  }
  block_bytes_ = *bb;
  conn->set_progress_timeout(options_.progress_timeout);
  s.conn = std::move(conn);
  return Status::Ok();
}

// Key i goes to the request's i % n-th stream; each stream runs `fn` on its keys on its own
// thread. A stream that fails is closed, so the next request reconnects it.
template <typename Fn>
Status PeerClient::OnAllStreams(std::span<const BlockKey> keys, Fn fn) {
  size_t used = std::min(streams_.size(), std::max<size_t>(keys.size(), 1));
  const size_t first = next_stream_.fetch_add(used, std::memory_order_relaxed);
  std::vector<Status> results(used);
  auto run = [&](size_t s) {
    std::vector<BlockKey> sub;
    std::vector<size_t> index;
    for (size_t i = s; i < keys.size(); i += used) sub.push_back(keys[i]), index.push_back(i);
    Stream& st = *streams_[(first + s) % streams_.size()];
    std::lock_guard lock(st.mu);
    results[s] = fn(st, sub, index);
    if (!results[s].ok()) st.conn.reset(), st.socket.Close();
  };
  std::vector<std::thread> threads;
  for (size_t s = 1; s < used; ++s) threads.emplace_back(run, s);
  run(0);
  for (auto& t : threads) t.join();
  for (auto& st : results) {
    if (!st.ok()) return st;
  }
  return Status::Ok();
}

// Its callers close the stream on any error, Connected()'s too: a no-op there, as Connected()
// fails with the stream closed already.
Result<Frame> PeerClient::AskTiers(Stream& s, Op op, std::span<const BlockKey> keys, Deadline d) {
  TPUSYNC_RETURN_IF_ERROR(Connected(s, d));
  BodyWriter w;
  WriteKeyList(w, keys);
  TPUSYNC_RETURN_IF_ERROR(s.conn->Send(op, w.bytes(), d, static_cast<uint32_t>(keys.size())));
  TPUSYNC_ASSIGN_OR_RETURN(Frame tiers, s.conn->Expect(Op::kTiers, d));
  if (tiers.body.size() != keys.size()) return BadFrame("TIERS count");
  return tiers;
}

Result<std::vector<Tier>> PeerClient::Exists(std::span<const BlockKey> keys, Deadline d) {
  Stream& s = *streams_[0];
  std::lock_guard lock(s.mu);
  Result<Frame> f = AskTiers(s, Op::kExists, keys, d);
  if (!f.ok()) {
    s.conn.reset();
    s.socket.Close();
    return f.status();
  }
  std::vector<Tier> tiers(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    auto t = std::to_integer<uint8_t>(f->body[i]);
    tiers[i] = TierFromCode(t);
  }
  return tiers;
}

Status PeerClient::Pull(std::span<const BlockKey> keys, BlockSink& sink, Deadline d, std::vector<uint8_t>& received) {
  received.assign(keys.size(), 0);
  return OnAllStreams(keys, [&](Stream& s, std::span<const BlockKey> sub, std::span<const size_t> index) {
    return PullOn(s, sub, index, sink, d, received);
  });
}

Status PeerClient::PullOn(Stream& s, std::span<const BlockKey> keys, std::span<const size_t> index, BlockSink& sink,
                          Deadline d, std::vector<uint8_t>& received) {
  if (keys.empty()) return Status::Ok();
  TPUSYNC_ASSIGN_OR_RETURN(Frame tiers, AskTiers(s, Op::kPull, keys, d));
  std::vector<uint8_t> expected(keys.size());
  for (size_t j = 0; j < keys.size(); ++j) expected[j] = std::to_integer<uint8_t>(tiers.body[j]) != 0;
  for (;;) {
    TPUSYNC_ASSIGN_OR_RETURN(FrameHeader h, s.conn->RecvBlockHeader(d));
    if (h.op == Op::kEnd) return Status::Ok();
    if (h.count >= keys.size() || !expected[h.count]) {
      return BadFrame("BLOCK index " + std::to_string(h.count) + " was not announced");
    }
    expected[h.count] = 0;
    if (h.status != 0) continue;  // the peer lost it since announcing it
    const size_t i = index[h.count];
    std::byte* dst = sink.Begin(i, h.body_len);
    uint64_t digest = 0;
    Status st = s.conn->RecvBlockPayload(dst, h.body_len, d, sink.wants_digests() ? &digest : nullptr);
    const bool landed = sink.Finish(i, h.body_len, st.ok() && dst != nullptr, digest);
    if (!st.ok()) return st;
    received[i] = landed;
  }
}

Status PeerClient::Push(std::span<const BlockKey> keys, BlockSource& source, Deadline d, std::vector<uint8_t>& stored) {
  stored.assign(keys.size(), 0);
  return OnAllStreams(keys, [&](Stream& s, std::span<const BlockKey> sub, std::span<const size_t> index) {
    return PushOn(s, sub, index, source, d, stored);
  });
}

Status PeerClient::PushOn(Stream& s, std::span<const BlockKey> keys, std::span<const size_t> index,
                          BlockSource& source, Deadline d, std::vector<uint8_t>& stored) {
  if (keys.empty()) return Status::Ok();
  TPUSYNC_ASSIGN_OR_RETURN(Frame wanted, AskTiers(s, Op::kPush, keys, d));
  for (uint32_t j = 0; j < keys.size(); ++j) {
    if (std::to_integer<uint8_t>(wanted.body[j]) == 0) continue;
    Result<std::span<const std::byte>> data = source.Open(index[j]);
    Status st = data.ok() ? s.conn->SendBlock(j, data->data(), data->size(), d) : s.conn->SendAbsent(j, d);
    if (data.ok()) source.Close(index[j]);
    TPUSYNC_RETURN_IF_ERROR(st);
  }
  TPUSYNC_RETURN_IF_ERROR(s.conn->Send(Op::kEnd, {}, d));
  TPUSYNC_ASSIGN_OR_RETURN(Frame done, s.conn->Expect(Op::kPushDone, d));
  if (done.body.size() != keys.size()) return BadFrame("PUSH_DONE count");
  for (size_t j = 0; j < keys.size(); ++j) stored[index[j]] = std::to_integer<uint8_t>(done.body[j]) != 0;
  return Status::Ok();
}

Result<std::shared_ptr<PeerClient>> PeerPool::Get(const std::string& address) {
  TPUSYNC_ASSIGN_OR_RETURN(std::string member, members_.Admit(address));
  {
    std::lock_guard lock(mu_);
    if (auto it = clients_.find(member); it != clients_.end()) return it->second;
  }
  TPUSYNC_ASSIGN_OR_RETURN(std::unique_ptr<PeerClient> c, PeerClient::Connect(member, secret_, options_));
  std::shared_ptr<PeerClient> shared = std::move(c);
  std::lock_guard lock(mu_);
  return clients_.try_emplace(member, shared).first->second;
}

void PeerPool::Forget(const std::string& address) {
  std::lock_guard lock(mu_);
  clients_.erase(address);
}

namespace {

class StoreSink : public BlockSink {
 public:
  StoreSink(Store& store, std::span<const BlockKey> keys, bool digests)
      : digests_(keys.size()), store_(store), keys_(keys), leases_(keys.size()), want_digests_(digests) {}
  bool wants_digests() const override { return want_digests_; }
  std::byte* Begin(size_t i, uint64_t length) override {
    if (length > store_.block_bytes()) return nullptr;
    // No wait for another writer of the key (it could outlast the peer's progress deadline):
    // its block counts as held if it committed by the end of the pull.
    Result<WriteLease> l = store_.Reserve(keys_[i], /*wait=*/false);
    if (!l.ok()) return nullptr;
    leases_[i].emplace(std::move(l).value());
    return leases_[i]->data();
  }
  bool Finish(size_t i, uint64_t length, bool ok, uint64_t digest) override {
    const bool landed = ok && leases_[i] && leases_[i]->Commit(length).ok();
    if (landed) {
      bytes_ += length;
      ++blocks_;
      digests_[i] = digest;  // each index is written by one stream only
    }
    leases_[i].reset();  // an uncommitted lease gives its slot back: nothing partial is published
    return landed;
  }
  std::atomic<uint64_t> bytes_{0}, blocks_{0};
  std::vector<uint64_t> digests_;

 private:
  Store& store_;
  std::span<const BlockKey> keys_;
  std::vector<std::optional<WriteLease>> leases_;
  bool want_digests_;
};

class StoreSource : public BlockSource {
 public:
  StoreSource(Store& store, std::span<const BlockKey> keys) : store_(store), keys_(keys), leases_(keys.size()) {}
  Result<std::span<const std::byte>> Open(size_t i) override {
    TPUSYNC_ASSIGN_OR_RETURN(ReadLease l, store_.Acquire(keys_[i]));
    leases_[i].emplace(std::move(l));
    return std::span<const std::byte>(leases_[i]->data(), leases_[i]->size());
  }
  void Close(size_t i) override { leases_[i].reset(); }

 private:
  Store& store_;
  std::span<const BlockKey> keys_;
  std::vector<std::optional<ReadLease>> leases_;
};

}  // namespace

Status PullIntoStore(PeerClient& peer, Store& store, std::span<const BlockKey> keys, Deadline d, PullResult& out,
                     bool digests) {
  LookupResult local = store.Lookup(keys, false);
  std::vector<BlockKey> missing;
  std::vector<size_t> where;
  out.held.assign(keys.size(), kAbsent);
  out.digests.assign(keys.size(), 0);
  for (size_t i = 0; i < keys.size(); ++i) {
    if (local.tiers[i] != Tier::kNone) {
      out.held[i] = kHeld;
    } else {
      missing.push_back(keys[i]);
      where.push_back(i);
    }
  }
  if (missing.empty()) return Status::Ok();
  StoreSink sink(store, missing, digests);
  std::vector<uint8_t> received;
  Status st = peer.Pull(missing, sink, d, received);
  out.bytes = sink.bytes_;
  out.blocks = sink.blocks_;
  LookupResult after = store.Lookup(missing, false);  // a block another writer stored meanwhile counts too
  for (size_t j = 0; j < missing.size(); ++j) {
    const size_t i = where[j];
    if (received[j]) {
      out.held[i] = kLanded;
      out.digests[i] = sink.digests_[j];
    } else if (after.tiers[j] != Tier::kNone) {
      out.held[i] = kHeld;
    }
  }
  return st;
}

Status PushFromStore(PeerClient& peer, Store& store, std::span<const BlockKey> keys, Deadline d,
                     std::vector<uint8_t>& stored) {
  StoreSource source(store, keys);
  return peer.Push(keys, source, d, stored);
}

}  // namespace tpusync::net
