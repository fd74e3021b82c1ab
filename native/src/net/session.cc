#include "net/session.h"

#include <aegis.h>
#include <aegis128x2.h>
#include <openssl/crypto.h>

#include "tpusync/net/frame.h"

namespace tpusync::net {

namespace {

// libaegis picks its implementations once per process (it also does so from a constructor,
// which a static link may not keep): before any state is used.
bool AegisReady() {
  static const bool ready = aegis_init() == 0;
  return ready;
}

}  // namespace

struct SessionCipher::Direction {
  SessionKey key;
  // One of the two, by the session's mode: libaegis forbids one key for both.
  aegis128x2_mac_state mac;
  aegis128x2_state aead;
  uint64_t seq = 0;   // frames so far in this direction: the next frame's nonce
  bool open = false;  // a frame is in progress
};

SessionCipher::SessionCipher(const SessionKey& send_key, const SessionKey& recv_key, bool encrypt)
    : send_(std::make_unique<Direction>()), recv_(std::make_unique<Direction>()), encrypt_(encrypt) {
  send_->key = send_key;
  recv_->key = recv_key;
}

SessionCipher::~SessionCipher() {
  // The session's keys do not outlive it in freed memory.
  for (Direction* d : {send_.get(), recv_.get()}) {
    if (d != nullptr) OPENSSL_cleanse(d, sizeof *d);
  }
}

Status SessionCipher::Begin(Direction& dir, std::span<const std::byte> header) {
  if (!AegisReady()) return Internal("libaegis: no implementation for this CPU");
  if (dir.seq == UINT64_MAX) return FailedPrecondition("session exhausted its frame counter; reconnect");
  // 128-bit nonce: the frame's sequence number, little-endian, then eight zero bytes.
  uint8_t nonce[aegis128x2_NPUBBYTES] = {};
  for (int i = 0; i < 8; ++i) nonce[i] = static_cast<uint8_t>(dir.seq >> (8 * i));
  ++dir.seq;
  const auto* key = reinterpret_cast<const uint8_t*>(dir.key.data());
  const auto* h = reinterpret_cast<const uint8_t*>(header.data());
  if (encrypt_) {  // AEGIS-128X2: the header is the associated data, the body the message
    aegis128x2_state_init(&dir.aead, h, header.size(), nonce, key);
  } else {  // AEGIS-128X2-MAC over the header (fixed size), then the body
    aegis128x2_mac_init(&dir.mac, key, nonce);
    if (aegis128x2_mac_update(&dir.mac, h, header.size()) != 0) return Internal("AEGIS-MAC update failed");
  }
  dir.open = true;
  return Status::Ok();
}

Status SessionCipher::BeginSeal(std::span<const std::byte> header) { return Begin(*send_, header); }
Status SessionCipher::BeginOpen(std::span<const std::byte> header) { return Begin(*recv_, header); }

Status SessionCipher::SealPart(const std::byte* in, std::byte* out, size_t n) {
  if (!send_->open) return FailedPrecondition("SealPart outside a frame");
  const auto* src = reinterpret_cast<const uint8_t*>(in);
  const int rc = encrypt_ ? aegis128x2_state_encrypt_update(&send_->aead, reinterpret_cast<uint8_t*>(out), src, n)
                          : aegis128x2_mac_update(&send_->mac, src, n);
  return rc == 0 ? Status::Ok() : Internal("AEGIS-128X2 seal failed");
}

Status SessionCipher::OpenPart(std::byte* data, size_t n) {
  if (!recv_->open) return FailedPrecondition("OpenPart outside a frame");
  auto* p = reinterpret_cast<uint8_t*>(data);
  const int rc = encrypt_ ? aegis128x2_state_decrypt_update(&recv_->aead, p, p, n)  // in place
                          : aegis128x2_mac_update(&recv_->mac, p, n);
  return rc == 0 ? Status::Ok() : Internal("AEGIS-128X2 open failed");
}

Status SessionCipher::EndSeal(std::byte tag[kTagBytes]) {
  if (!send_->open) return FailedPrecondition("EndSeal outside a frame");
  send_->open = false;
  auto* t = reinterpret_cast<uint8_t*>(tag);
  const int rc = encrypt_ ? aegis128x2_state_encrypt_final(&send_->aead, t, kTagBytes)
                          : aegis128x2_mac_final(&send_->mac, t, kTagBytes);
  return rc == 0 ? Status::Ok() : Internal("AEGIS-128X2 tag failed");
}

Status SessionCipher::EndOpen(const std::byte tag[kTagBytes]) {
  if (!recv_->open) return FailedPrecondition("EndOpen outside a frame");
  recv_->open = false;
  const auto* t = reinterpret_cast<const uint8_t*>(tag);
  // Both compare in constant time.
  const int rc = encrypt_ ? aegis128x2_state_decrypt_final(&recv_->aead, t, kTagBytes)
                          : aegis128x2_mac_verify(&recv_->mac, t, kTagBytes);
  if (rc != 0) {
    return BadFrame(
        "authentication tag mismatch (the frame was altered, replayed or injected into this session)");
  }
  return Status::Ok();
}

}  // namespace tpusync::net
