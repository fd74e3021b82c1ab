#include "base/copy.h"

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace tpusync {
namespace {

constexpr size_t kStreamingThreshold = 64 << 10;

__attribute__((target("avx2"))) void StreamingCopy(char* d, const char* s, size_t n) {
  size_t head = (32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31;
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  for (; n >= 128; n -= 128, d += 128, s += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64));
    __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 96), e);
  }
  std::memcpy(d, s, n);
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
