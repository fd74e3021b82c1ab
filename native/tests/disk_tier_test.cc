#include "store/disk_tier.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "base/posix_io.h"
#include "test_util.h"

namespace tpusync {
namespace {

using namespace testing;  // NOLINT(google-build-using-namespace): the tests' own helpers

DiskTierOptions Opts(const TempDir& d, uint64_t blocks = 4) {
  return {.dir = d.path(), .capacity_bytes = blocks * kBlock, .block_bytes = kBlock};
}

// Writes Pattern(Key(i)) of `length` bytes into a fresh extent and returns it.
uint32_t WriteBlock(DiskTier& t, uint64_t i, uint64_t length) {
  AlignedBuffer buf(kBlock);
  auto data = Pattern(Key(i), length);
  std::memcpy(buf.data(), data.data(), length);
  uint32_t e = *t.Allocate();
  Status st = t.Write(e, Key(i), buf.data(), length, 100 + i);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return e;
}

void FlipByte(const std::string& path, uint64_t offset) {
  int fd = ::open(path.c_str(), O_RDWR);
  unsigned char b;
  ASSERT_EQ(::pread(fd, &b, 1, offset), 1);
  b ^= 0xff;
  ASSERT_EQ(::pwrite(fd, &b, 1, offset), 1);
  ::close(fd);
}

// Reads block i from extent e and expects kDataLoss saying `why`.
void ExpectDataLoss(DiskTier& t, uint32_t e, uint64_t i, const std::string& why) {
  AlignedBuffer out(kBlock);
  Status st = t.Read(e, Key(i), kBlock, out.data());
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find(why), std::string::npos) << st.ToString();
}

TEST(DiskTier, RoundTripAndRecoveryAfterReopen) {
  TempDir d;
  uint32_t e0, e1;
  {
    auto t = DiskTier::Open(Opts(d));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_TRUE((*t)->recovered().empty());
    e0 = WriteBlock(**t, 0, kBlock);
    e1 = WriteBlock(**t, 1, 100);
    AlignedBuffer out(kBlock);
    ASSERT_TRUE((*t)->Read(e1, Key(1), 100, out.data()).ok());
    EXPECT_EQ(std::memcmp(out.data(), Pattern(Key(1), 100).data(), 100), 0);
  }
  auto t = DiskTier::Open(Opts(d));
  ASSERT_TRUE(t.ok());
  ASSERT_EQ((*t)->recovered().size(), 2u);
  EXPECT_EQ((*t)->recovered()[0].extent, e0);
  EXPECT_EQ((*t)->recovered()[1].key, Key(1));
  EXPECT_EQ((*t)->recovered()[1].length, 100u);
  EXPECT_EQ((*t)->free_extents(), 2u);
  AlignedBuffer out(kBlock);
  ASSERT_TRUE((*t)->Read(e0, Key(0), kBlock, out.data()).ok());
  EXPECT_EQ(std::memcmp(out.data(), Pattern(Key(0), kBlock).data(), kBlock), 0);
}

TEST(DiskTier, CorruptedPayloadIsDataLoss) {
  TempDir d;
  auto t = DiskTier::Open(Opts(d));
  ASSERT_TRUE(t.ok());
  uint32_t e = WriteBlock(**t, 3, kBlock);
  FlipByte((*t)->path(), e * (4096 + kBlock) + 4096 + 17);
  ExpectDataLoss(**t, e, 3, "checksum mismatch");
}

TEST(DiskTier, WrongKeyOrLengthIsDataLoss) {
  TempDir d;
  auto t = DiskTier::Open(Opts(d));
  ASSERT_TRUE(t.ok());
  uint32_t e = WriteBlock(**t, 3, kBlock);
  AlignedBuffer out(kBlock);
  EXPECT_EQ((*t)->Read(e, Key(4), kBlock, out.data()).code(), StatusCode::kDataLoss);
  EXPECT_EQ((*t)->Read(e, Key(3), 10, out.data()).code(), StatusCode::kDataLoss);
}

TEST(DiskTier, DamagedHeaderIsNotRecovered) {
  TempDir d;
  std::string path;
  {
    auto t = DiskTier::Open(Opts(d));
    ASSERT_TRUE(t.ok());
    uint32_t e = WriteBlock(**t, 5, kBlock);
    WriteBlock(**t, 6, kBlock);
    path = (*t)->path();
    FlipByte(path, e * (4096 + kBlock) + 30);  // inside the key field
  }
  auto t = DiskTier::Open(Opts(d));
  ASSERT_TRUE(t.ok());
  ASSERT_EQ((*t)->recovered().size(), 1u);
  EXPECT_EQ((*t)->recovered()[0].key, Key(6));
  EXPECT_EQ((*t)->damaged_at_open(), 1u);
}

TEST(DiskTier, TruncatedFileIsDataLossNotACrash) {
  TempDir d;
  auto t = DiskTier::Open(Opts(d));
  ASSERT_TRUE(t.ok());
  WriteBlock(**t, 0, kBlock);
  uint32_t e1 = WriteBlock(**t, 1, kBlock);
  ASSERT_EQ(::truncate((*t)->path().c_str(), e1 * (4096 + kBlock) + 4096 + 100), 0);
  ExpectDataLoss(**t, e1, 1, "truncated");
}

TEST(DiskTier, CapacityBeyondTheFilesystemIsRefused) {
  TempDir d;
  struct statvfs vfs{};
  ASSERT_EQ(::statvfs(d.path().c_str(), &vfs), 0);
  uint64_t avail = uint64_t{vfs.f_bavail} * vfs.f_frsize;
  auto t = DiskTier::Open({.dir = d.path(), .capacity_bytes = avail + (1ull << 30), .block_bytes = 1ull << 20});
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kResourceExhausted);
}

TEST(DiskTier, FullDeviceWriteIsAnError) {
  TempDir d;
  // The kernel's /dev/full answers every write with ENOSPC: a disk that filled up after open.
  std::filesystem::create_symlink("/dev/full", d.file("extents.dat"));
  auto t = DiskTier::Open(Opts(d));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  AlignedBuffer buf(kBlock);
  std::memset(buf.data(), 1, kBlock);
  Status st = (*t)->Write(*(*t)->Allocate(), Key(1), buf.data(), kBlock, 1);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("No space left"), std::string::npos);
}

TEST(DiskTier, ReopeningWithAnotherBlockSizeIsRefusedAndLosesNothing) {
  TempDir d;
  {
    auto t = DiskTier::Open(Opts(d));
    ASSERT_TRUE(t.ok());
    WriteBlock(**t, 7, kBlock);
  }
  auto other = DiskTier::Open({.dir = d.path(), .capacity_bytes = 8 * kBlock, .block_bytes = 2 * kBlock});
  EXPECT_EQ(other.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(other.status().message().find("block_bytes 8192"), std::string::npos) << other.status().ToString();
  auto t = DiskTier::Open(Opts(d));
  ASSERT_TRUE(t.ok());
  ASSERT_EQ((*t)->recovered().size(), 1u);
  EXPECT_EQ((*t)->recovered()[0].key, Key(7));
}

TEST(DiskTier, OneOwnerAndSaneGeometry) {
  TempDir d;
  auto t = DiskTier::Open(Opts(d));
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(DiskTier::Open(Opts(d)).status().code(), StatusCode::kFailedPrecondition);
  TempDir d2;
  EXPECT_EQ(DiskTier::Open({.dir = d2.path(), .capacity_bytes = 1 << 20, .block_bytes = 100}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(DiskTier::Open({.dir = d2.path(), .capacity_bytes = 10, .block_bytes = 4096}).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tpusync
