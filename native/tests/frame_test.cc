// The frame parser against hand-made malformed frames, and the handshake against bad peers.
#include "tpusync/net/frame.h"

#include <gtest/gtest.h>
#include <sys/socket.h>

#include <cstring>
#include <thread>

#include "checksum.h"
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
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
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

TEST(Handshake, SameSecretAuthenticatesBothWays) {
  Pair p;
  FramedConn server(p.a, 4096), client(p.b, 0);
  Status server_st;
  std::thread t([&] { server_st = ServerHandshake(server, Secret("0123456789abcdef"), 8192, Deadline::After(std::chrono::seconds(5))); });
  auto bb = ClientHandshake(client, Secret("0123456789abcdef"), Deadline::After(std::chrono::seconds(5)));
  t.join();
  ASSERT_TRUE(server_st.ok()) << server_st.ToString();
  ASSERT_TRUE(bb.ok()) << bb.status().ToString();
  EXPECT_EQ(*bb, 8192u);
}

TEST(Handshake, WrongSecretIsRefusedOnBothSides) {
  Pair p;
  FramedConn server(p.a, 4096), client(p.b, 0);
  Status server_st;
  std::thread t([&] {
    server_st = ServerHandshake(server, Secret("0123456789abcdef"), 8192, Deadline::After(std::chrono::seconds(5)));
    if (!server_st.ok()) (void)server.SendError(server_st, Deadline::After(std::chrono::seconds(1)));
  });
  auto bb = ClientHandshake(client, Secret("fedcba9876543210"), Deadline::After(std::chrono::seconds(5)));
  t.join();
  EXPECT_EQ(server_st.code(), StatusCode::kUnauthenticated);
  EXPECT_EQ(bb.status().code(), StatusCode::kUnauthenticated);  // the server closed without AUTH_OK
}

TEST(Handshake, DataBeforeAuthenticationIsRefused) {
  Pair p;
  FramedConn server(p.a, 4096), client(p.b, 0);
  std::vector<std::byte> keys(16);
  ASSERT_TRUE(client.Send(Op::kPull, keys, Deadline::After(std::chrono::seconds(1)), 1).ok());
  Status st = ServerHandshake(server, Secret("0123456789abcdef"), 8192, Deadline::After(std::chrono::seconds(5)));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("expected HELLO"), std::string::npos);
}

TEST(Handshake, OversizedHelloIsRefusedOnItsHeader) {
  Pair p;
  FramedConn server(p.a, 4096);
  FrameHeader h;
  h.op = Op::kHello;
  h.body_len = 32 << 20;  // announced, never sent: the server must not wait for it
  auto hdr = Encode(h);
  ASSERT_TRUE(p.b.WriteFull(hdr.data(), hdr.size(), Deadline::After(std::chrono::seconds(1))).ok());
  Status st = ServerHandshake(server, Secret("0123456789abcdef"), 8192, Deadline::After(std::chrono::seconds(5)));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("HELLO body of 33554432 bytes"), std::string::npos) << st.ToString();
}

TEST(Handshake, SilentPeerCostsOnlyTheDeadline) {
  Pair p;
  FramedConn server(p.a, 4096);
  Status st = ServerHandshake(server, Secret("0123456789abcdef"), 8192, Deadline::After(std::chrono::milliseconds(50)));
  EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded);
}

TEST(Conn, CorruptedBodyAndPayloadAreDetected) {
  Pair p;
  FramedConn tx(p.a, 0), rx(p.b, 1 << 16);
  auto d = Deadline::After(std::chrono::seconds(2));
  // A body whose checksum does not match.
  FrameHeader h;
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
  // A block whose trailer does not match its payload.
  std::vector<std::byte> payload(5000, std::byte{7});
  FrameHeader bh;
  bh.op = Op::kBlock;
  bh.body_len = payload.size();
  auto bhdr = Encode(bh);
  uint64_t wrong = 1;
  ASSERT_TRUE(p.a.WriteFull(bhdr.data(), bhdr.size(), d).ok());
  ASSERT_TRUE(p.a.WriteFull(payload.data(), payload.size(), d).ok());
  ASSERT_TRUE(p.a.WriteFull(&wrong, 8, d).ok());
  auto got = rx.RecvBlockHeader(d);
  ASSERT_TRUE(got.ok());
  std::vector<std::byte> dst(5000);
  Status st = rx.RecvBlockPayload(dst.data(), got->body_len, d);
  EXPECT_NE(st.message().find("payload checksum mismatch"), std::string::npos);
  // And a good one passes.
  ASSERT_TRUE(tx.SendBlock(3, payload.data(), payload.size(), d).ok());
  got = rx.RecvBlockHeader(d);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->count, 3u);
  EXPECT_TRUE(rx.RecvBlockPayload(dst.data(), got->body_len, d).ok());
  EXPECT_EQ(dst, payload);
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
  Pair p;
  FramedConn tx(p.a, 0), rx(p.b, 1 << 20);
  auto d = Deadline::After(std::chrono::seconds(5));
  std::vector<std::byte> payload((600 << 10) + 123);  // three 256 KiB chunks, the last one short
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<std::byte>(i * 31 + (i >> 12));
  Status sent;
  std::thread sender([&] { sent = tx.SendBlock(9, payload.data(), payload.size(), d); });
  auto got = rx.RecvBlockHeader(d);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->count, 9u);
  ASSERT_EQ(got->body_len, payload.size());
  std::vector<std::byte> dst(payload.size());
  uint64_t digest = 0;
  EXPECT_TRUE(rx.RecvBlockPayload(dst.data(), got->body_len, d, &digest).ok());
  sender.join();
  EXPECT_TRUE(sent.ok());
  EXPECT_EQ(dst, payload);
  EXPECT_EQ(digest, XXH3_64bits(payload.data(), payload.size()));
}

}  // namespace
}  // namespace tpusync::net
