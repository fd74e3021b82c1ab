#include "base/mac.h"

#include <intel-ipsec-mb.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>

#include <string>
#include <vector>

namespace tpusync {

Result<MacKey> HmacSha256(std::span<const std::byte> key, std::string_view label, std::span<const std::byte> data) {
  std::vector<unsigned char> msg(label.begin(), label.end());
  const auto* d = reinterpret_cast<const unsigned char*>(data.data());
  msg.insert(msg.end(), d, d + data.size());
  MacKey out{};
  size_t out_len = 0;
  if (EVP_Q_mac(nullptr, "HMAC", nullptr, "SHA256", nullptr, key.data(), key.size(), msg.data(), msg.size(),
                reinterpret_cast<unsigned char*>(out.data()), out.size(), &out_len) == nullptr ||
      out_len != out.size()) {
    return Internal("HMAC-SHA256 failed");
  }
  return out;
}

Status RandomBytes(std::span<std::byte> out) {
  if (RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(out.size())) != 1) {
    return Internal("RAND_bytes failed: the system has no entropy to give");
  }
  return Status::Ok();
}

bool ConstantTimeEqual(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

IMB_MGR* IpsecManager() {
  static IMB_MGR* const mgr = [] {
    IMB_MGR* m = alloc_mb_mgr(0);
    if (m != nullptr) {
      IMB_ARCH arch;
      init_mb_mgr_auto(m, &arch);
    }
    return m;
  }();
  return mgr;
}

struct Gmac::Key {
  alignas(64) gcm_key_data expanded;
};

Gmac::Gmac(std::unique_ptr<Key> key) : key_(std::move(key)) {}
Gmac::Gmac(Gmac&&) noexcept = default;
Gmac& Gmac::operator=(Gmac&&) noexcept = default;
Gmac::~Gmac() = default;

Result<Gmac> Gmac::Create(const MacKey& key) {
  IMB_MGR* m = IpsecManager();
  if (m == nullptr) return Internal("intel-ipsec-mb: no multi-buffer manager");
  auto k = std::make_unique<Key>();
  IMB_AES256_GCM_PRE(m, key.data(), &k->expanded);
  return Gmac(std::move(k));
}

GmacTag Gmac::Tag(const GmacIv& iv, std::initializer_list<std::span<const std::byte>> parts) const {
  IMB_MGR* m = IpsecManager();  // non-null: Create checked
  gcm_context_data ctx;
  IMB_AES256_GMAC_INIT(m, &key_->expanded, &ctx, reinterpret_cast<const uint8_t*>(iv.data()), iv.size());
  for (std::span<const std::byte> p : parts) {
    if (!p.empty()) IMB_AES256_GMAC_UPDATE(m, &key_->expanded, &ctx, reinterpret_cast<const uint8_t*>(p.data()), p.size());
  }
  GmacTag tag{};
  IMB_AES256_GMAC_FINALIZE(m, &key_->expanded, &ctx, reinterpret_cast<uint8_t*>(tag.data()), tag.size());
  return tag;
}

}  // namespace tpusync
