#include "base/checksum.h"

#include <new>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace tpusync {

// The same XXH3 compiled for AVX2 (checksum_avx2.cc, about 3x the SSE2 speed) and for AVX-512
// (checksum_avx512.cc, a third faster again), the widest the CPU has picked at run time.
uint64_t ChecksumAvx2(const void* data, size_t len);
void UpdateAvx2(void* state, const void* data, size_t len);
uint64_t ChecksumAvx512(const void* data, size_t len);
void UpdateAvx512(void* state, const void* data, size_t len);

namespace {
const bool kHaveAvx512 = __builtin_cpu_supports("avx512f");
const bool kHaveAvx2 = __builtin_cpu_supports("avx2");
}  // namespace

uint64_t Checksum(const void* data, size_t len) {
  if (kHaveAvx512) return ChecksumAvx512(data, len);
  return kHaveAvx2 ? ChecksumAvx2(data, len) : XXH3_64bits(data, len);
}

StreamingChecksum::StreamingChecksum() : state_(XXH3_createState()) {
  if (state_ == nullptr) throw std::bad_alloc();
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
}

StreamingChecksum::~StreamingChecksum() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }

void StreamingChecksum::Update(const void* data, size_t len) {
  if (kHaveAvx512) {
    UpdateAvx512(state_, data, len);
  } else if (kHaveAvx2) {
    UpdateAvx2(state_, data, len);
  } else {
    XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, len);
  }
}

uint64_t StreamingChecksum::Digest() const { return XXH3_64bits_digest(static_cast<XXH3_state_t*>(state_)); }

}  // namespace tpusync
