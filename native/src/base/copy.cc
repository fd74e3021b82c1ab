#include "base/copy.h"

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace tpusync {
namespace {

constexpr size_t kStreamingThreshold = 64 << 10;

// Non-temporal stores: a copy into (or out of) the pool is not read back by this core soon, and
// a regular store would first read each destination line into the cache. Four pages are copied
// side by side, a line of each in turn, as glibc's large memcpy does: the memory controller
// then keeps four streams open, which lifts a 2 MiB block's copy from 9.1 to 11.6 GB/s here
// (the loop of one stream before it), level with memcpy of 1 GiB in one call (11.5 GB/s).
__attribute__((target("avx2"))) void StreamLines(char* d, const char* s, size_t lines) {
  for (; lines > 0; --lines, d += 64, s += 64) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 32), b);
  }
}

__attribute__((target("avx2"))) void StreamingCopy(char* d, const char* s, size_t n) {
  constexpr size_t kPage = 4096, kPages = 4, kGroup = kPages * kPage;
  // Whole destination lines: a streaming store fills a write-combining buffer per line, and
  // four streams of half-filled lines (a destination 32 bytes off a line) ran at half the rate.
  size_t head = (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63;
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  for (; n >= kGroup; n -= kGroup, d += kGroup, s += kGroup) {
    for (size_t off = 0; off < kPage; off += 64) {
      for (size_t p = 0; p < kPages; ++p) StreamLines(d + p * kPage + off, s + p * kPage + off, 1);
    }
  }
  StreamLines(d, s, n / 64);
  d += n & ~size_t{63}, s += n & ~size_t{63};
  std::memcpy(d, s, n & 63);
  _mm_sfence();  // streaming stores are weakly ordered: publish them before the slot is committed
}

const bool kHaveAvx2 = __builtin_cpu_supports("avx2");

}  // namespace

void CopyBytes(void* dst, const void* src, size_t n) {
  if (n >= kStreamingThreshold && kHaveAvx2) {
    StreamingCopy(static_cast<char*>(dst), static_cast<const char*>(src), n);
  } else {
    std::memcpy(dst, src, n);
  }
}

}  // namespace tpusync
