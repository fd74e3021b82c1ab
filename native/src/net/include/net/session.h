// SessionCipher: what makes a data-port connection one authenticated session rather than an
// authenticated handshake. Every frame after the handshake carries a 128-bit AEGIS-128X2 tag
// (draft-irtf-cfrg-aegis-aead) under a key of its direction, derived from the pool's secret and
// the handshake transcript, with the frame's sequence number as the nonce: a frame injected,
// replayed, reordered, dropped or spliced in from another connection fails its tag, and a relay
// that passed the handshake through learns no key. Bodies are authenticated (AEGIS-128X2-MAC
// over the header and the body) or, when the session is encrypted, encrypted as well
// (AEGIS-128X2, the header as associated data). From libaegis (native/cmake/aegis.cmake): on
// CPUs without AVX-512 AES-GCM's GHASH is the slow half of the pair; measured on this project's
// machine (AMD EPYC, AES-NI, VAES and VPCLMULQDQ on AVX2), a 256 KiB body already in cache is
// tagged at 31 GB/s a core by AEGIS-128X2-MAC and encrypted at 19 GB/s, where intel-ipsec-mb's
// GMAC did 4.1 and its AES-256-GCM 2.3 (docs/wire-protocol.md).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "tpusync/status.h"

namespace tpusync::net {

constexpr size_t kKeyBytes = 16;  // AEGIS-128X2's key
constexpr size_t kTagBytes = 16;
using SessionKey = std::array<std::byte, kKeyBytes>;

class SessionCipher {
 public:
  SessionCipher(const SessionKey& send_key, const SessionKey& recv_key, bool encrypt);
  ~SessionCipher();
  SessionCipher(const SessionCipher&) = delete;
  SessionCipher& operator=(const SessionCipher&) = delete;

  bool encrypts() const { return encrypt_; }

  // One outgoing frame: Begin with its header, then every body byte in order (`out` receives
  // the ciphertext when encrypting and may be null otherwise), then EndSeal writes the tag.
  Status BeginSeal(std::span<const std::byte> header);
  Status SealPart(const std::byte* in, std::byte* out, size_t n);
  Status EndSeal(std::byte tag[kTagBytes]);
  // One incoming frame, the same way; OpenPart decrypts in place when encrypting. EndOpen
  // fails (kInvalidArgument) unless the tag matches: nothing read since BeginOpen may be used.
  Status BeginOpen(std::span<const std::byte> header);
  Status OpenPart(std::byte* data, size_t n);
  Status EndOpen(const std::byte tag[kTagBytes]);

 private:
  struct Direction;
  Status Begin(Direction& dir, std::span<const std::byte> header);
  std::unique_ptr<Direction> send_, recv_;
  bool encrypt_;
};

}  // namespace tpusync::net
