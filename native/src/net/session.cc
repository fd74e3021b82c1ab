#include "net/session.h"

#include <openssl/evp.h>

#include <climits>

namespace tpusync::net {
namespace {

struct CtxFree {
  void operator()(EVP_CIPHER_CTX* c) const { EVP_CIPHER_CTX_free(c); }
};

Status CipherFailed(const char* what) { return Internal(std::string("ChaCha20-Poly1305 ") + what + " failed"); }

// OpenSSL's update calls take an int length.
constexpr size_t kMaxUpdate = INT_MAX & ~size_t{63};

}  // namespace

struct SessionCipher::Direction {
  std::unique_ptr<EVP_CIPHER_CTX, CtxFree> ctx{EVP_CIPHER_CTX_new()};
  SessionKey key;
  uint64_t seq = 0;  // frames so far in this direction: the next frame's nonce
  bool open = false;  // a frame is in progress
};

SessionCipher::SessionCipher(const SessionKey& send_key, const SessionKey& recv_key, bool encrypt)
    : send_(std::make_unique<Direction>()), recv_(std::make_unique<Direction>()), encrypt_(encrypt) {
  send_->key = send_key;
  recv_->key = recv_key;
}

SessionCipher::~SessionCipher() = default;

Status SessionCipher::Begin(Direction& dir, bool seal, std::span<const std::byte> header) {
  if (dir.ctx == nullptr) return CipherFailed("context allocation");
  if (dir.seq == UINT64_MAX) return FailedPrecondition("session exhausted its frame counter; reconnect");
  // 96-bit nonce: four zero bytes, then the frame's sequence number, little-endian.
  unsigned char nonce[12] = {};
  for (int i = 0; i < 8; ++i) nonce[4 + i] = static_cast<unsigned char>(dir.seq >> (8 * i));
  ++dir.seq;
  const auto* key = reinterpret_cast<const unsigned char*>(dir.key.data());
  if (EVP_CipherInit_ex(dir.ctx.get(), EVP_chacha20_poly1305(), nullptr, key, nonce, seal ? 1 : 0) != 1) {
    return CipherFailed("init");
  }
  int n = 0;
  if (EVP_CipherUpdate(dir.ctx.get(), nullptr, &n, reinterpret_cast<const unsigned char*>(header.data()),
                       static_cast<int>(header.size())) != 1) {
    return CipherFailed("header");
  }
  dir.open = true;
  return Status::Ok();
}

Status SessionCipher::BeginSeal(std::span<const std::byte> header) { return Begin(*send_, true, header); }
Status SessionCipher::BeginOpen(std::span<const std::byte> header) { return Begin(*recv_, false, header); }

Status SessionCipher::SealPart(const std::byte* in, std::byte* out, size_t n) {
  if (!send_->open) return FailedPrecondition("SealPart outside a frame");
  for (size_t off = 0; off < n;) {
    const int step = static_cast<int>(std::min(n - off, kMaxUpdate));
    int len = 0;
    auto* dst = encrypt_ ? reinterpret_cast<unsigned char*>(out + off) : nullptr;  // null: associated data
    if (EVP_CipherUpdate(send_->ctx.get(), dst, &len, reinterpret_cast<const unsigned char*>(in + off), step) != 1) {
      return CipherFailed("update");
    }
    off += static_cast<size_t>(step);
  }
  return Status::Ok();
}

Status SessionCipher::OpenPart(std::byte* data, size_t n) {
  if (!recv_->open) return FailedPrecondition("OpenPart outside a frame");
  for (size_t off = 0; off < n;) {
    const int step = static_cast<int>(std::min(n - off, kMaxUpdate));
    int len = 0;
    auto* p = reinterpret_cast<unsigned char*>(data + off);
    if (EVP_CipherUpdate(recv_->ctx.get(), encrypt_ ? p : nullptr, &len, p, step) != 1) return CipherFailed("update");
    off += static_cast<size_t>(step);
  }
  return Status::Ok();
}

Status SessionCipher::EndSeal(std::byte tag[kTagBytes]) {
  if (!send_->open) return FailedPrecondition("EndSeal outside a frame");
  send_->open = false;
  int n = 0;
  unsigned char rest[16];
  if (EVP_EncryptFinal_ex(send_->ctx.get(), rest, &n) != 1 ||
      EVP_CIPHER_CTX_ctrl(send_->ctx.get(), EVP_CTRL_AEAD_GET_TAG, kTagBytes, tag) != 1) {
    return CipherFailed("tag");
  }
  return Status::Ok();
}

Status SessionCipher::EndOpen(const std::byte tag[kTagBytes]) {
  if (!recv_->open) return FailedPrecondition("EndOpen outside a frame");
  recv_->open = false;
  unsigned char want[kTagBytes];
  std::copy(reinterpret_cast<const unsigned char*>(tag), reinterpret_cast<const unsigned char*>(tag) + kTagBytes,
            want);
  int n = 0;
  unsigned char rest[16];
  if (EVP_CIPHER_CTX_ctrl(recv_->ctx.get(), EVP_CTRL_AEAD_SET_TAG, kTagBytes, want) != 1 ||
      EVP_DecryptFinal_ex(recv_->ctx.get(), rest, &n) != 1) {
    return InvalidArgument(
        "bad frame: authentication tag mismatch (the frame was altered, replayed or injected into this session)");
  }
  return Status::Ok();
}

}  // namespace tpusync::net
