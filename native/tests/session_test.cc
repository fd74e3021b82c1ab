// The data port's session cipher held to the AEGIS specification: libaegis against the known
// answers of draft-irtf-cfrg-aegis-aead-18 (section "Test Vectors": AEGIS-128X2 and
// AEGISMAC-128X2), then SessionCipher's frames against the composition docs/wire-protocol.md
// states (the tag of frame n is AEGIS-128X2-MAC(key, n || 0^64, header || body); encrypted,
// AEGIS-128X2(key, n || 0^64, ad = header, body)).
#include <aegis.h>
#include <aegis128x2.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "net/session.h"

namespace tpusync::net {
namespace {

std::vector<uint8_t> Hex(const std::string& h) {
  std::vector<uint8_t> out;
  for (size_t i = 0; i + 1 < h.size(); i += 2) out.push_back(static_cast<uint8_t>(std::stoi(h.substr(i, 2), nullptr, 16)));
  return out;
}

struct AeadVector {
  const char *key, *nonce, *ad, *msg, *ct, *tag128;
};

// draft-irtf-cfrg-aegis-aead-18, AEGIS-128X2 Test Vectors 1 and 2.
const AeadVector kAegis128X2[] = {
    {"000102030405060708090a0b0c0d0e0f", "101112131415161718191a1b1c1d1e1f", "", "", "", "63117dc57756e402819a82e13eca8379"},
    {"000102030405060708090a0b0c0d0e0f", "101112131415161718191a1b1c1d1e1f", "0102030401020304", "040506070405060704050607040506070405060704050607040506070405060704050607040506070405060704050607040506070405060704050607040506070405060704050607040506070405060704050607040506070405060704050607040506070405060704050607040506070405060704050607", "5795544301997f93621b278809d6331b3bfa6f18e90db12c4aa35965b5e98c5fc6fb4e54bcb6111842c20637252eff747cb3a8f85b37de80919a589fe0f24872bc926360696739e05520647e390989e1eb5fd42f99678a0276a498f8c454761c9d6aacb647ad56be62b29c22cd4b5761b38f43d5a5ee062f", "1aebc200804f405cab637f2adebb6d77"}
};

TEST(Aegis, Aegis128X2MatchesTheDraftsTestVectors) {
  ASSERT_EQ(aegis_init(), 0);
  for (const AeadVector& v : kAegis128X2) {
    auto key = Hex(v.key), nonce = Hex(v.nonce), ad = Hex(v.ad), msg = Hex(v.msg);
    std::vector<uint8_t> ct(msg.size()), tag(16);
    ASSERT_EQ(aegis128x2_encrypt_detached(ct.data(), tag.data(), tag.size(), msg.data(), msg.size(), ad.data(),
                                          ad.size(), nonce.data(), key.data()),
              0);
    EXPECT_EQ(ct, Hex(v.ct));
    EXPECT_EQ(tag, Hex(v.tag128));
  }
}

TEST(Aegis, Aegis128X2MacMatchesTheDraftsTestVector) {
  ASSERT_EQ(aegis_init(), 0);
  // draft-irtf-cfrg-aegis-aead-18, AEGISMAC-128X2 Test Vector.
  auto key = Hex("10010000000000000000000000000000"), nonce = Hex("10000200000000000000000000000000"), data = Hex("000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f202122");
  aegis128x2_mac_state st;
  aegis128x2_mac_init(&st, key.data(), nonce.data());
  ASSERT_EQ(aegis128x2_mac_update(&st, data.data(), 7), 0);  // in pieces, as frames are MACed
  ASSERT_EQ(aegis128x2_mac_update(&st, data.data() + 7, data.size() - 7), 0);
  std::vector<uint8_t> tag(16);
  ASSERT_EQ(aegis128x2_mac_final(&st, tag.data(), tag.size()), 0);
  EXPECT_EQ(tag, Hex("6873ee34e6b5c59143b6d35c5e4f2c6e"));
}

SessionKey KeyOf(uint8_t fill) {
  SessionKey k;
  k.fill(std::byte{fill});
  return k;
}

std::vector<uint8_t> NonceOf(uint64_t seq) {
  std::vector<uint8_t> n(16, 0);
  for (int i = 0; i < 8; ++i) n[i] = static_cast<uint8_t>(seq >> (8 * i));
  return n;
}

// Frames 0..2 of a session: the header, then the body in two pieces.
TEST(Session, AnAuthenticatedFramesTagIsAegisMacOfItsHeaderAndBody) {
  SessionCipher sender(KeyOf(7), KeyOf(9), false), receiver(KeyOf(9), KeyOf(7), false);
  std::vector<std::byte> header(32, std::byte{0x11}), body(5000, std::byte{0x42});
  const auto k = std::vector<uint8_t>(16, 7);
  for (uint64_t seq = 0; seq < 3; ++seq) {
    std::byte tag[kTagBytes];
    ASSERT_TRUE(sender.BeginSeal(header).ok());
    ASSERT_TRUE(sender.SealPart(body.data(), nullptr, 1234).ok());
    ASSERT_TRUE(sender.SealPart(body.data() + 1234, nullptr, body.size() - 1234).ok());
    ASSERT_TRUE(sender.EndSeal(tag).ok());

    std::vector<uint8_t> input(reinterpret_cast<const uint8_t*>(header.data()),
                               reinterpret_cast<const uint8_t*>(header.data()) + header.size());
    input.insert(input.end(), reinterpret_cast<const uint8_t*>(body.data()),
                 reinterpret_cast<const uint8_t*>(body.data()) + body.size());
    aegis128x2_mac_state st;
    auto nonce = NonceOf(seq);
    aegis128x2_mac_init(&st, k.data(), nonce.data());
    ASSERT_EQ(aegis128x2_mac_update(&st, input.data(), input.size()), 0);
    std::vector<uint8_t> want(16);
    ASSERT_EQ(aegis128x2_mac_final(&st, want.data(), want.size()), 0);
    EXPECT_EQ(std::vector<uint8_t>(reinterpret_cast<uint8_t*>(tag), reinterpret_cast<uint8_t*>(tag) + 16), want);

    ASSERT_TRUE(receiver.BeginOpen(header).ok());
    ASSERT_TRUE(receiver.OpenPart(body.data(), body.size()).ok());
    EXPECT_TRUE(receiver.EndOpen(tag).ok());
  }
}

TEST(Session, AnEncryptedFrameIsAegis128X2WithTheHeaderAsAssociatedData) {
  SessionCipher sender(KeyOf(3), KeyOf(4), true), receiver(KeyOf(4), KeyOf(3), true);
  std::vector<std::byte> header(32, std::byte{0x21}), body(3000);
  for (size_t i = 0; i < body.size(); ++i) body[i] = std::byte(i * 31);
  std::vector<std::byte> sealed(body.size());
  std::byte tag[kTagBytes];
  ASSERT_TRUE(sender.BeginSeal(header).ok());
  ASSERT_TRUE(sender.SealPart(body.data(), sealed.data(), 1000).ok());
  ASSERT_TRUE(sender.SealPart(body.data() + 1000, sealed.data() + 1000, body.size() - 1000).ok());
  ASSERT_TRUE(sender.EndSeal(tag).ok());

  const auto k = std::vector<uint8_t>(16, 3);
  auto nonce = NonceOf(0);
  std::vector<uint8_t> ct(body.size()), want(16);
  ASSERT_EQ(aegis128x2_encrypt_detached(ct.data(), want.data(), 16, reinterpret_cast<const uint8_t*>(body.data()),
                                        body.size(), reinterpret_cast<const uint8_t*>(header.data()), header.size(),
                                        nonce.data(), k.data()),
            0);
  EXPECT_EQ(std::vector<uint8_t>(reinterpret_cast<uint8_t*>(sealed.data()),
                                 reinterpret_cast<uint8_t*>(sealed.data()) + sealed.size()),
            ct);
  EXPECT_EQ(std::vector<uint8_t>(reinterpret_cast<uint8_t*>(tag), reinterpret_cast<uint8_t*>(tag) + 16), want);

  std::vector<std::byte> opened = sealed;
  ASSERT_TRUE(receiver.BeginOpen(header).ok());
  ASSERT_TRUE(receiver.OpenPart(opened.data(), opened.size()).ok());
  ASSERT_TRUE(receiver.EndOpen(tag).ok());
  EXPECT_EQ(opened, body);
}

TEST(Session, AFlippedBitOrAReplayedFrameFailsItsTag) {
  for (bool encrypt : {false, true}) {
    SessionCipher sender(KeyOf(1), KeyOf(2), encrypt), receiver(KeyOf(2), KeyOf(1), encrypt);
    std::vector<std::byte> header(32, std::byte{1}), body(4096, std::byte{2}), out(body.size());
    std::byte tag[kTagBytes];
    ASSERT_TRUE(sender.BeginSeal(header).ok());
    ASSERT_TRUE(sender.SealPart(body.data(), out.data(), body.size()).ok());
    ASSERT_TRUE(sender.EndSeal(tag).ok());
    std::vector<std::byte> wire = encrypt ? out : body;
    std::vector<std::byte> flipped = wire;
    flipped[100] ^= std::byte{1};
    ASSERT_TRUE(receiver.BeginOpen(header).ok());
    ASSERT_TRUE(receiver.OpenPart(flipped.data(), flipped.size()).ok());
    EXPECT_EQ(receiver.EndOpen(tag).code(), StatusCode::kMalformed) << encrypt;
    // The same frame again is frame 1 to the receiver now: its nonce differs, so it fails too.
    ASSERT_TRUE(receiver.BeginOpen(header).ok());
    ASSERT_TRUE(receiver.OpenPart(wire.data(), wire.size()).ok());
    EXPECT_EQ(receiver.EndOpen(tag).code(), StatusCode::kMalformed) << encrypt;
  }
}

}  // namespace
}  // namespace tpusync::net
