// The frame parser against hand-made malformed frames, and the handshake against bad peers.
#include "tpusync/net/frame.h"

#include <gtest/gtest.h>
#include <sys/socket.h>

#include <cstring>
#include <thread>

#include "base/checksum.h"
#include "net/conn.h"

// The reference XXH3-64, compiled without any vector unit, to hold the dispatched ones to.
#define XXH_INLINE_ALL
#define XXH_VECTOR 0
#include <xxhash.h>

namespace tpusync::net {
namespace {

std::array<std::byte, kHeaderBytes> Encode(FrameHeader h) {
  std::array<std::byte, kHeaderBytes> b;
  EncodeHeader(h, b.data());
  return b;
}

TEST(Frame, RoundTrip) {
  FrameHeader h;
  h.op = Op::kPull;
  h.count = 7;
  h.body_len = 112;
  h.body_sum = 0xdeadbeefcafe;
  auto b = Encode(h);
  auto d = DecodeHeader(b.data(), 1 << 20);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->op, Op::kPull);
  EXPECT_EQ(d->count, 7u);
  EXPECT_EQ(d->body_len, 112u);
  EXPECT_EQ(d->body_sum, 0xdeadbeefcafeu);
}

TEST(Frame, MalformedHeadersAreRejectedWithAReason) {
  struct Case {
    const char* name;
    void (*mutate)(std::array<std::byte, kHeaderBytes>&);
    const char* reason;
  };
  const Case cases[] = {
      {"magic", [](auto& b) { b[0] = std::byte{'X'}; }, "wrong magic"},
      {"version", [](auto& b) { b[4] = std::byte{9}; }, "protocol version 9"},
      {"unknown op", [](auto& b) { b[6] = std::byte{200}; }, "unknown op 200"},
      {"op zero", [](auto& b) { b[6] = std::byte{0}; }, "unknown op 0"},
      {"reserved", [](auto& b) { b[10] = std::byte{1}; }, "reserved"},
      {"huge body", [](auto& b) { b[23] = std::byte{0x7f}; }, "exceeds"},
      {"too many keys", [](auto& b) { b[15] = std::byte{0x10}; }, "keys exceed"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    FrameHeader h;
    h.op = Op::kExists;
    h.count = 1;
    h.body_len = 16;
    auto b = Encode(h);
    c.mutate(b);
    auto d = DecodeHeader(b.data(), 1 << 20);
    ASSERT_FALSE(d.ok());
    EXPECT_EQ(d.status().code(), StatusCode::kMalformed);
    EXPECT_NE(d.status().message().find(c.reason), std::string::npos) << d.status().message();
  }
}

TEST(Frame, BlockPayloadIsBoundedByTheBlockSize) {
  FrameHeader h;
  h.op = Op::kBlock;
  h.body_len = (1 << 20) + 1;
  auto b = Encode(h);
  EXPECT_FALSE(DecodeHeader(b.data(), 1 << 20).ok());
  h.body_len = 1 << 20;
  b = Encode(h);
  EXPECT_TRUE(DecodeHeader(b.data(), 1 << 20).ok());
}

TEST(Frame, KeyListsMustMatchTheirCount) {
  std::vector<std::byte> body(size_t{16} * 3);  // three 16-byte keys
  EXPECT_TRUE(ParseKeyList(body, 3).ok());
  EXPECT_FALSE(ParseKeyList(body, 4).ok());
  EXPECT_FALSE(ParseKeyList(std::span(body).first(47), 3).ok());
}

TEST(Frame, BodyReaderNeverReadsPastTheEnd) {
  std::vector<std::byte> body = {std::byte{5}, std::byte{0}, std::byte{0}, std::byte{0}, std::byte{'a'}};
  BodyReader r(body);
  std::string s;
  EXPECT_FALSE(r.Str(&s, 100));  // claims 5 bytes, has 1
  uint64_t v;
  EXPECT_FALSE(r.U64(&v));
  EXPECT_FALSE(r.done());
}

// A connected socket pair: the handshake and frame validation over a real socket.
struct Pair {
  Pair() {
    int fds[2];
    ::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, fds);
    a = Socket(UniqueFd(fds[0]));
    b = Socket(UniqueFd(fds[1]));
  }
  Socket a, b;
};

Secret TestSecret() { return Secret("0123456789abcdef"); }
Deadline Soon() { return Deadline::After(std::chrono::seconds(5)); }

struct Handshaken {
  Status server;
  Result<uint64_t> client = Internal("not run");
};

// Both handshakes at once, the server's on a thread; the server replies with its refusal.
Handshaken Handshake(FramedConn& server, FramedConn& client, HandshakeOptions server_options,
                     HandshakeOptions client_options, const Secret& client_secret = TestSecret()) {
  Handshaken r;
  std::thread t([&] {
    r.server = ServerHandshake(server, TestSecret(), server_options, Soon());
    if (!r.server.ok()) (void)server.SendError(r.server, Soon());
  });
  r.client = ClientHandshake(client, client_secret, client_options, Soon());
  t.join();
  return r;
}

// Both ends of one sealed session, without a handshake.
void SealBoth(FramedConn& a, FramedConn& b, bool encrypt = false) {
  SessionKey up{}, down{};
  up.fill(std::byte{1});
  down.fill(std::byte{2});
  a.Seal(std::make_unique<SessionCipher>(up, down, encrypt));
  b.Seal(std::make_unique<SessionCipher>(down, up, encrypt));
}

// Every byte `s` has to read now (the peer has written and stopped).
std::vector<std::byte> Drain(Socket& s) {
  std::vector<std::byte> out;
  std::byte buf[65536];
  for (;;) {
    ssize_t n = ::recv(s.fd(), buf, sizeof buf, MSG_DONTWAIT);
    if (n <= 0) return out;
    out.insert(out.end(), buf, buf + n);
  }
}

TEST(Handshake, SameSecretAuthenticatesBothWaysAndSealsTheSession) {
  Pair p;
  FramedConn server(p.a, 4096), client(p.b, 0);
  Handshaken r = Handshake(server, client, {.block_bytes = 8192}, {});
  ASSERT_TRUE(r.server.ok()) << r.server.ToString();
  ASSERT_TRUE(r.client.ok()) << r.client.status().ToString();
  EXPECT_EQ(*r.client, 8192u);
  EXPECT_TRUE(server.sealed() && client.sealed());
  std::vector<std::byte> keys(32, std::byte{5});
  ASSERT_TRUE(client.Send(Op::kPull, keys, Soon(), 2).ok());
  Result<Frame> f = server.Recv(Soon());
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->body, keys);
}

TEST(Handshake, WrongSecretIsRefusedOnBothSides) {
  Pair p;
  FramedConn server(p.a, 4096), client(p.b, 0);
  Handshaken r = Handshake(server, client, {.block_bytes = 8192}, {}, Secret("fedcba9876543210"));
  EXPECT_EQ(r.server.code(), StatusCode::kUnauthenticated);
  EXPECT_EQ(r.client.status().code(), StatusCode::kUnauthenticated);  // the server closed without AUTH_OK
}

TEST(Handshake, ABlockSizeOfAnotherPoolIsRefusedNamingBothSizes) {
  Pair p;
  FramedConn server(p.a, 4096), client(p.b, 0);
  Handshaken r = Handshake(server, client, {.block_bytes = 8192}, {.block_bytes = 4096});
  EXPECT_EQ(r.server.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.client.status().code(), StatusCode::kFailedPrecondition);
  for (const std::string& m : {r.server.message(), r.client.status().message()}) {
    EXPECT_NE(m.find("8192"), std::string::npos) << m;
    EXPECT_NE(m.find("4096"), std::string::npos) << m;
  }
}

TEST(Handshake, EncryptionIsOnWhenEitherSideAsksAndTheBytesOnTheWireAreNotThePlaintext) {
  for (auto [server_asks, client_asks] : {std::pair{true, false}, std::pair{false, true}}) {
    Pair p;
    FramedConn server(p.a, 1 << 16), client(p.b, 0);
    Handshaken r = Handshake(server, client, {.block_bytes = 1 << 16, .encrypt = server_asks}, {.encrypt = client_asks});
    ASSERT_TRUE(r.server.ok() && r.client.ok()) << r.server.ToString() << r.client.status().ToString();
    std::vector<std::byte> payload(20000);
    for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<std::byte>("secret KV bytes "[i % 16]);
    ASSERT_TRUE(server.SendBlock(0, payload.data(), payload.size(), Soon()).ok());
    std::vector<std::byte> wire = Drain(p.b);
    const std::string_view text(reinterpret_cast<const char*>(wire.data()), wire.size());
    EXPECT_EQ(text.find("secret KV bytes"), std::string::npos);
    // The same bytes, decrypted by the client.
    Pair q;
    FramedConn server2(q.a, 1 << 16), client2(q.b, 0);
    ASSERT_TRUE(Handshake(server2, client2, {.block_bytes = 1 << 16, .encrypt = server_asks}, {.encrypt = client_asks})
                    .client.ok());
    ASSERT_TRUE(server2.SendBlock(0, payload.data(), payload.size(), Soon()).ok());
    auto h = client2.RecvBlockHeader(Soon());
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    std::vector<std::byte> dst(payload.size());
    ASSERT_TRUE(client2.RecvBlockPayload(dst.data(), h->body_len, Soon()).ok());
    EXPECT_EQ(dst, payload);
  }
}

// A stranger who relays a member's handshake to another member ends up on an authenticated
// connection, but without the session's keys: whatever it sends of its own is refused.
TEST(Handshake, ARelayedHandshakeGivesTheRelayNothingToSendWith) {
  Pair to_client, to_server;  // client <-> relay, relay <-> server
  FramedConn client(to_client.a, 0), server(to_server.a, 4096);
  auto relay = [](Socket& from, Socket& to) {
    std::byte hdr[kHeaderBytes];
    ASSERT_TRUE(from.ReadFull(hdr, kHeaderBytes, Soon()).ok());
    Result<FrameHeader> h = DecodeHeader(hdr, 0);
    ASSERT_TRUE(h.ok());
    std::vector<std::byte> body(h->body_len);
    ASSERT_TRUE(from.ReadFull(body.data(), body.size(), Soon()).ok());
    ASSERT_TRUE(to.WriteFull(hdr, kHeaderBytes, Soon()).ok());
    ASSERT_TRUE(to.WriteFull(body.data(), body.size(), Soon()).ok());
  };
  Status server_st;
  std::thread s([&] { server_st = ServerHandshake(server, TestSecret(), {.block_bytes = 4096}, Soon()); });
  std::thread r([&] {
    relay(to_client.b, to_server.b);  // HELLO
    relay(to_server.b, to_client.b);  // CHALLENGE
    relay(to_client.b, to_server.b);  // AUTH
    relay(to_server.b, to_client.b);  // AUTH_OK
  });
  Result<uint64_t> client_st = ClientHandshake(client, TestSecret(), {}, Soon());
  r.join();
  s.join();
  ASSERT_TRUE(server_st.ok() && client_st.ok());
  // The relay's own request, as v1 would have taken it (a plain frame)...
  FramedConn relay_conn(to_server.b, 0);
  std::vector<std::byte> key(16);
  ASSERT_TRUE(relay_conn.Send(Op::kPull, key, Soon(), 1).ok());
  const Op ops[] = {Op::kPull};
  Result<Frame> f = server.RecvKeyRequest(ops, Soon());
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("body_sum must be 0"), std::string::npos) << f.status().ToString();
  // ... or sealed under a key it guessed.
  Pair again;
  FramedConn victim(again.a, 4096), stranger(again.b, 0);
  SealBoth(victim, stranger);
  SessionKey guess{};
  victim.Seal(std::make_unique<SessionCipher>(guess, guess, false));
  ASSERT_TRUE(stranger.Send(Op::kPull, key, Soon(), 1).ok());
  f = victim.RecvKeyRequest(ops, Soon());
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("authentication tag mismatch"), std::string::npos) << f.status().ToString();
}

TEST(Handshake, DataBeforeAuthenticationIsRefused) {
  Pair p;
  FramedConn server(p.a, 4096), client(p.b, 0);
  std::vector<std::byte> keys(16);
  ASSERT_TRUE(client.Send(Op::kPull, keys, Deadline::After(std::chrono::seconds(1)), 1).ok());
  Status st = ServerHandshake(server, TestSecret(), {.block_bytes = 8192}, Soon());
  EXPECT_EQ(st.code(), StatusCode::kMalformed);
  EXPECT_NE(st.message().find("expected HELLO"), std::string::npos);
}

TEST(Handshake, AnOldPeerIsToldWhichProtocolVersionsMeet) {
  Pair p;
  FramedConn server(p.a, 4096);
  FrameHeader h;
  h.version = 2;  // AES-256-GCM sessions
  h.op = Op::kHello;
  h.body_len = 32;
  auto hdr = Encode(h);
  ASSERT_TRUE(p.b.WriteFull(hdr.data(), hdr.size(), Soon()).ok());
  Status st = ServerHandshake(server, TestSecret(), {.block_bytes = 8192}, Soon());
  EXPECT_EQ(st.code(), StatusCode::kMalformed);
  EXPECT_NE(st.message().find("protocol version 2, this build speaks 3"), std::string::npos) << st.ToString();
}

TEST(Handshake, OversizedHelloIsRefusedOnItsHeader) {
  Pair p;
  FramedConn server(p.a, 4096);
  FrameHeader h;
  h.op = Op::kHello;
  h.body_len = 32 << 20;  // announced, never sent: the server must not wait for it
  auto hdr = Encode(h);
  ASSERT_TRUE(p.b.WriteFull(hdr.data(), hdr.size(), Deadline::After(std::chrono::seconds(1))).ok());
  Status st = ServerHandshake(server, TestSecret(), {.block_bytes = 8192}, Soon());
  EXPECT_EQ(st.code(), StatusCode::kMalformed) << st.ToString();
  EXPECT_NE(st.message().find("HELLO body of 33554432 bytes"), std::string::npos) << st.ToString();
}

TEST(Handshake, SilentPeerCostsOnlyTheDeadline) {
  Pair p;
  FramedConn server(p.a, 4096);
  Status st = ServerHandshake(server, TestSecret(), {.block_bytes = 8192}, Deadline::After(std::chrono::milliseconds(50)));
  EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded);
}

TEST(Conn, CorruptedBodyIsDetected) {
  Pair p;
  FramedConn rx(p.b, 1 << 16);
  auto d = Deadline::After(std::chrono::seconds(2));
  FrameHeader h;  // a body whose checksum does not match
  h.op = Op::kExists;
  h.count = 1;
  h.body_len = 16;
  h.body_sum = 42;
  auto hdr = Encode(h);
  std::vector<std::byte> body(16);
  ASSERT_TRUE(p.a.WriteFull(hdr.data(), hdr.size(), d).ok());
  ASSERT_TRUE(p.a.WriteFull(body.data(), body.size(), d).ok());
  auto f = rx.Recv(d);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("body checksum mismatch"), std::string::npos);
}

// One byte changed on the wire, a frame replayed, a frame dropped: each fails its tag.
TEST(Conn, ASealedFrameAlteredReplayedOrDroppedIsRefused) {
  std::vector<std::byte> payload(5000, std::byte{7});
  const auto capture = [&](FramedConn& tx, Socket& wire_end) {
    EXPECT_TRUE(tx.SendBlock(3, payload.data(), payload.size(), Soon()).ok());
    return Drain(wire_end);
  };
  const auto deliver = [&](Socket& to, FramedConn& rx, const std::vector<std::byte>& bytes) {
    EXPECT_TRUE(to.WriteFull(bytes.data(), bytes.size(), Soon()).ok());
    auto h = rx.RecvBlockHeader(Soon());
    if (!h.ok()) return h.status();
    std::vector<std::byte> dst(payload.size());
    return rx.RecvBlockPayload(dst.data(), h->body_len, Soon());
  };
  {  // altered
    Pair wire, link;
    FramedConn tx(wire.a, 0), rx(link.b, 1 << 16);
    SealBoth(tx, rx);
    std::vector<std::byte> frame = capture(tx, wire.b);
    frame[kHeaderBytes + 100] ^= std::byte{1};
    Status st = deliver(link.a, rx, frame);
    EXPECT_NE(st.message().find("authentication tag mismatch"), std::string::npos) << st.ToString();
  }
  {  // replayed, and dropped (the second frame arrives where the first was expected)
    Pair wire, link;
    FramedConn tx(wire.a, 0), rx(link.b, 1 << 16);
    SealBoth(tx, rx);
    std::vector<std::byte> first = capture(tx, wire.b), second = capture(tx, wire.b);
    ASSERT_TRUE(deliver(link.a, rx, first).ok());
    Status replayed = deliver(link.a, rx, first);
    EXPECT_NE(replayed.message().find("authentication tag mismatch"), std::string::npos) << replayed.ToString();
    Pair link2;
    FramedConn rx2(link2.b, 1 << 16), unused(link2.a, 0);
    SealBoth(unused, rx2);
    Status dropped = deliver(link2.a, rx2, second);
    EXPECT_NE(dropped.message().find("authentication tag mismatch"), std::string::npos) << dropped.ToString();
  }
}

TEST(Conn, AFrameThatStopsMidwayCostsTheProgressTimeoutNotTheDeadline) {
  Pair p;
  FramedConn tx(p.a, 0), rx(p.b, 1 << 20);
  SealBoth(tx, rx);
  rx.set_progress_timeout(std::chrono::milliseconds(100));
  FrameHeader h;
  h.op = Op::kBlock;
  h.body_len = 1 << 20;
  auto hdr = Encode(h);
  ASSERT_TRUE(p.a.WriteFull(hdr.data(), hdr.size(), Soon()).ok());  // and no payload
  const auto start = Clock::now();
  // The header itself fails its tag only at the end; what must not happen is waiting 60 s.
  auto got = rx.RecvBlockHeader(Deadline::After(std::chrono::seconds(60)));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(rx.AwaitPayload(Deadline::After(std::chrono::seconds(60))).code(), StatusCode::kDeadlineExceeded);
  std::vector<std::byte> dst(1 << 20);
  EXPECT_EQ(rx.RecvBlockPayload(dst.data(), got->body_len, Deadline::After(std::chrono::seconds(60))).code(),
            StatusCode::kDeadlineExceeded);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
}

TEST(Checksum, EveryVectorWidthComputesTheReferenceXxh3) {
  std::vector<std::byte> data(1 << 20);
  uint64_t x = 88172645463325252ULL;
  for (auto& b : data) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = static_cast<std::byte>(x);
  }
  for (size_t len : {size_t{0}, size_t{1}, size_t{17}, size_t{240}, size_t{241}, size_t{1024}, size_t{4097},
                     size_t{256 << 10}, size_t{(1 << 20) - 3}}) {
    const uint64_t want = XXH3_64bits(data.data(), len);
    EXPECT_EQ(Checksum(data.data(), len), want) << len;
    StreamingChecksum s;  // in uneven pieces, as a socket delivers them
    for (size_t off = 0, piece = 1; off < len; off += piece, piece = piece * 3 + 5) {
      s.Update(data.data() + off, std::min(piece, len - off));
    }
    EXPECT_EQ(s.Digest(), want) << len;
  }
}

TEST(Conn, AMultiChunkBlockArrivesWholeWithTheDigestOfItsBytes) {
  for (bool encrypt : {false, true}) {
    Pair p;
    FramedConn tx(p.a, 0), rx(p.b, 1 << 20);
    SealBoth(tx, rx, encrypt);
    std::vector<std::byte> payload((600 << 10) + 123);  // three 256 KiB chunks, the last one short
    for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<std::byte>(i * 31 + (i >> 12));
    Status sent;
    std::thread sender([&] { sent = tx.SendBlock(9, payload.data(), payload.size(), Soon()); });
    auto got = rx.RecvBlockHeader(Soon());
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(got->count, 9u);
    ASSERT_EQ(got->body_len, payload.size());
    std::vector<std::byte> dst(payload.size());
    uint64_t digest = 0;
    EXPECT_TRUE(rx.RecvBlockPayload(dst.data(), got->body_len, Soon(), &digest).ok());
    sender.join();
    EXPECT_TRUE(sent.ok());
    EXPECT_EQ(dst, payload);
    EXPECT_EQ(digest, XXH3_64bits(payload.data(), payload.size())) << encrypt;
  }
}

// The read that ends a block's payload takes the tag and the start of the next frame with it:
// frames sent back to back, before the receiver reads any, each still arrive whole, and a next
// frame read that way counts as input waiting.
TEST(FramedConn, FramesReadAheadWithABlocksEndArriveWholeAndCountAsInput) {
  for (bool encrypt : {false, true}) {
    Pair p;
    FramedConn tx(p.a, 0), rx(p.b, 1 << 20);
    SealBoth(tx, rx, encrypt);
    std::vector<std::byte> one(1000, std::byte{7}), two(5000, std::byte{9});  // all fit the socket buffer
    ASSERT_TRUE(tx.SendBlock(0, one.data(), one.size(), Soon()).ok());
    ASSERT_TRUE(tx.SendBlock(1, two.data(), two.size(), Soon()).ok());
    ASSERT_TRUE(tx.SendAbsent(2, Soon()).ok());
    ASSERT_TRUE(tx.Send(Op::kEnd, {}, Soon()).ok());
    for (const auto* want : {&one, &two}) {
      auto h = rx.RecvBlockHeader(Soon());
      ASSERT_TRUE(h.ok()) << h.status().ToString();
      ASSERT_EQ(h->body_len, want->size());
      std::vector<std::byte> dst(want->size());
      ASSERT_TRUE(rx.RecvBlockPayload(dst.data(), dst.size(), Soon()).ok());
      EXPECT_EQ(dst, *want) << encrypt;
    }
    auto absent = rx.RecvBlockHeader(Soon());
    ASSERT_TRUE(absent.ok());
    EXPECT_EQ(absent->count, 2u);
    EXPECT_NE(absent->status, 0);
    auto end = rx.RecvBlockHeader(Soon());
    ASSERT_TRUE(end.ok());
    EXPECT_EQ(end->op, Op::kEnd);

    // A block, then END's header read with its payload's end: the socket has nothing left,
    // yet the connection has input.
    ASSERT_TRUE(tx.SendBlock(3, one.data(), one.size(), Soon()).ok());
    ASSERT_TRUE(tx.Send(Op::kEnd, {}, Soon()).ok());
    auto h = rx.RecvBlockHeader(Soon());
    ASSERT_TRUE(h.ok());
    std::vector<std::byte> dst(one.size());
    ASSERT_TRUE(rx.RecvBlockPayload(dst.data(), dst.size(), Soon()).ok());
    const Deadline now = Deadline::After(std::chrono::milliseconds(0));
    Result<bool> ready = rx.WaitReadable(-1, now);
    ASSERT_TRUE(ready.ok() && *ready) << "the header read ahead is input waiting";
    EXPECT_TRUE(rx.RecvBlockHeader(Soon()).ok());
    EXPECT_EQ(rx.WaitReadable(-1, now).status().code(), StatusCode::kDeadlineExceeded);
  }
}

TEST(FramedConn, AnErrorReplyKeepsTheChannelInStepAMalformedFrameDoesNot) {
  Pair p;
  FramedConn a(p.a, 4096), b(p.b, 4096);
  ASSERT_TRUE(a.SendError(NotFound("no such block"), Soon()).ok());
  Result<Frame> f = b.Recv(Soon());
  EXPECT_EQ(f.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(b.in_step());
  // A reply is told by its frame, not its text: one that reads like a broken frame is a reply.
  ASSERT_TRUE(a.SendError(Status(StatusCode::kUnavailable, "bad frame: a peer's own words"), Soon()).ok());
  f = b.Recv(Soon());
  EXPECT_EQ(f.status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(b.in_step());
  std::vector<std::byte> junk(kHeaderBytes, std::byte{0x5a});
  ASSERT_TRUE(p.a.WriteFull(junk.data(), junk.size(), Soon()).ok());
  f = b.Recv(Soon());
  EXPECT_EQ(f.status().code(), StatusCode::kMalformed);
  EXPECT_FALSE(b.in_step());
}

}  // namespace
}  // namespace tpusync::net
