#include "net/session.h"

#include <intel-ipsec-mb.h>

#include "base/mac.h"
#include "tpusync/net/frame.h"

namespace tpusync::net {

struct SessionCipher::Direction {
  alignas(64) gcm_key_data key;
  gcm_context_data ctx;
  uint64_t seq = 0;   // frames so far in this direction: the next frame's nonce
  bool open = false;  // a frame is in progress
};

SessionCipher::SessionCipher(const SessionKey& send_key, const SessionKey& recv_key, bool encrypt)
    : send_(std::make_unique<Direction>()), recv_(std::make_unique<Direction>()), encrypt_(encrypt) {
  if (IMB_MGR* m = IpsecManager(); m != nullptr) {
    IMB_AES256_GCM_PRE(m, send_key.data(), &send_->key);
    IMB_AES256_GCM_PRE(m, recv_key.data(), &recv_->key);
  }
}

SessionCipher::~SessionCipher() = default;

Status SessionCipher::Begin(Direction& dir, std::span<const std::byte> header) {
  IMB_MGR* m = IpsecManager();
  if (m == nullptr) return Internal("intel-ipsec-mb: no multi-buffer manager");
  if (dir.seq == UINT64_MAX) return FailedPrecondition("session exhausted its frame counter; reconnect");
  // 96-bit nonce: four zero bytes, then the frame's sequence number, little-endian.
  uint8_t nonce[12] = {};
  for (int i = 0; i < 8; ++i) nonce[4 + i] = static_cast<uint8_t>(dir.seq >> (8 * i));
  ++dir.seq;
  const auto* h = reinterpret_cast<const uint8_t*>(header.data());
  if (encrypt_) {
    IMB_AES256_GCM_INIT_VAR_IV(m, &dir.key, &dir.ctx, nonce, sizeof nonce, h, header.size());
  } else {  // GMAC: GCM over associated data only, the header first, then the body
    IMB_AES256_GMAC_INIT(m, &dir.key, &dir.ctx, nonce, sizeof nonce);
    IMB_AES256_GMAC_UPDATE(m, &dir.key, &dir.ctx, h, header.size());
  }
  dir.open = true;
  return Status::Ok();
}

Status SessionCipher::BeginSeal(std::span<const std::byte> header) { return Begin(*send_, header); }
Status SessionCipher::BeginOpen(std::span<const std::byte> header) { return Begin(*recv_, header); }

Status SessionCipher::SealPart(const std::byte* in, std::byte* out, size_t n) {
  if (!send_->open) return FailedPrecondition("SealPart outside a frame");
  IMB_MGR* m = IpsecManager();
  const auto* src = reinterpret_cast<const uint8_t*>(in);
  if (encrypt_) {
    IMB_AES256_GCM_ENC_UPDATE(m, &send_->key, &send_->ctx, reinterpret_cast<uint8_t*>(out), src, n);
  } else {
    IMB_AES256_GMAC_UPDATE(m, &send_->key, &send_->ctx, src, n);
  }
  return Status::Ok();
}

Status SessionCipher::OpenPart(std::byte* data, size_t n) {
  if (!recv_->open) return FailedPrecondition("OpenPart outside a frame");
  IMB_MGR* m = IpsecManager();
  auto* p = reinterpret_cast<uint8_t*>(data);
  if (encrypt_) {
    IMB_AES256_GCM_DEC_UPDATE(m, &recv_->key, &recv_->ctx, p, p, n);  // in place
  } else {
    IMB_AES256_GMAC_UPDATE(m, &recv_->key, &recv_->ctx, p, n);
  }
  return Status::Ok();
}

Status SessionCipher::EndSeal(std::byte tag[kTagBytes]) {
  if (!send_->open) return FailedPrecondition("EndSeal outside a frame");
  send_->open = false;
  IMB_MGR* m = IpsecManager();
  auto* t = reinterpret_cast<uint8_t*>(tag);
  if (encrypt_) {
    IMB_AES256_GCM_ENC_FINALIZE(m, &send_->key, &send_->ctx, t, kTagBytes);
  } else {
    IMB_AES256_GMAC_FINALIZE(m, &send_->key, &send_->ctx, t, kTagBytes);
  }
  return Status::Ok();
}

Status SessionCipher::EndOpen(const std::byte tag[kTagBytes]) {
  if (!recv_->open) return FailedPrecondition("EndOpen outside a frame");
  recv_->open = false;
  IMB_MGR* m = IpsecManager();
  uint8_t want[kTagBytes];
  if (encrypt_) {
    IMB_AES256_GCM_DEC_FINALIZE(m, &recv_->key, &recv_->ctx, want, kTagBytes);
  } else {
    IMB_AES256_GMAC_FINALIZE(m, &recv_->key, &recv_->ctx, want, kTagBytes);
  }
  if (!ConstantTimeEqual(std::as_bytes(std::span(want)), {tag, kTagBytes})) {
    return BadFrame(
        "authentication tag mismatch (the frame was altered, replayed or injected into this session)");
  }
  return Status::Ok();
}

}  // namespace tpusync::net
