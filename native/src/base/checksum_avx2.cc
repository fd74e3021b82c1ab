// Built with -mavx2 (see CMakeLists.txt); only called after a run-time AVX2 check.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cstddef>
#include <cstdint>

namespace tpusync {

uint64_t ChecksumAvx2(const void* data, size_t len) { return XXH3_64bits(data, len); }

void UpdateAvx2(void* state, const void* data, size_t len) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state), data, len);
}

}  // namespace tpusync
