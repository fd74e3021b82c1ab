// Helpers of the shared tier's tests: two SharedTier objects on one directory are two hosts.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>

#include "base/posix_io.h"
#include "test_util.h"
#include "store/shared_tier.h"

namespace tpusync::testing {

constexpr uint64_t kFileBytes = 4096 + kBlock;  // header + payload
constexpr const char* kSecret = "the pool's secret, 16+ bytes";

// Two SharedTier objects on one directory are two hosts of a pool.
inline std::unique_ptr<SharedTier> Open(const TempDir& d, const std::string& layout = "model=m;tp=1;rank=0",
                                        uint64_t capacity = 0, const std::string& secret = kSecret) {
  auto t = SharedTier::Open({.dir = d.path(), .secret = secret, .layout = layout, .block_bytes = kBlock, .capacity_bytes = capacity,
                             .run_evictor = false});
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(*t);
}

inline Status WriteBlock(SharedTier& t, uint64_t i, uint64_t length = kBlock) {
  AlignedBuffer buf(kBlock);
  auto data = Pattern(Key(i), length);
  std::memcpy(buf.data(), data.data(), length);
  return t.Write(Key(i), buf.data(), length);
}

// Reads block i and checks its bytes; returns the read's status.
inline Status ReadBlock(SharedTier& t, uint64_t i, uint64_t length = kBlock) {
  AlignedBuffer buf(kBlock);
  Result<uint64_t> n = t.Read(Key(i), buf.data(), kBlock);
  if (!n.ok()) return n.status();
  EXPECT_EQ(*n, length);
  auto want = Pattern(Key(i), length);
  EXPECT_EQ(std::memcmp(buf.data(), want.data(), length), 0);
  return Status::Ok();
}

inline std::string FileOf(const SharedTier& t, uint64_t i) {
  const std::string hex = Key(i).ToHex();
  return t.root() + "/" + hex.substr(0, 2) + "/" + hex;
}

inline void SetAtime(const std::string& path, time_t seconds) {
  const timespec times[2] = {{seconds, 0}, {0, UTIME_OMIT}};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
}

}  // namespace tpusync::testing
