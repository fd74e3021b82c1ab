#include "base/copy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace tpusync {
namespace {

// CopyBytes takes the streaming path from 64 KiB: on Intel four pages side by side, then whole
// lines (elsewhere lines only), then the bytes left. Every size around those edges, at every
// alignment of either side, must land every byte and touch nothing past the end.
TEST(CopyBytesTest, CopiesEveryByteAtEverySizeAndAlignment) {
  const size_t kPage = 4096, kGroup = 4 * kPage;
  std::vector<size_t> sizes = {0, 1, 31, 63, 64, 65, 4095, (64 << 10) - 1};
  for (size_t base : {size_t{64} << 10, size_t{2} << 20}) {
    for (size_t extra : {size_t{0}, size_t{1}, size_t{63}, size_t{64}, kPage - 1, kGroup - 1, kGroup + 65}) {
      sizes.push_back(base + extra);
    }
  }
  std::vector<uint8_t> src((2 << 20) + 2 * kGroup + 256), dst(src.size());
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + (i >> 12));
  for (size_t n : sizes) {
    for (size_t src_off : {size_t{0}, size_t{5}, size_t{32}}) {
      for (size_t dst_off : {size_t{0}, size_t{3}, size_t{31}, size_t{47}, size_t{64}}) {
        std::fill(dst.begin(), dst.end(), uint8_t{0xEE});
        CopyBytes(dst.data() + dst_off, src.data() + src_off, n);
        for (size_t i = 0; i < dst_off; ++i) ASSERT_EQ(dst[i], 0xEE) << "before the copy, n=" << n;
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(dst[dst_off + i], src[src_off + i]) << "n=" << n << " src+" << src_off << " dst+" << dst_off
                                                        << " at " << i;
        }
        for (size_t i = dst_off + n; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xEE) << "past the copy, n=" << n;
      }
    }
  }
}

}  // namespace
}  // namespace tpusync
