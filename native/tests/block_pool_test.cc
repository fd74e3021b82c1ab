#include "store/block_pool.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <set>
#include <thread>

#include "base/posix_io.h"
#include "test_util.h"

namespace tpusync {
namespace {

using testing::Key;
using testing::Pattern;
using testing::ShmPath;

constexpr uint64_t kBlock = 16384;

BlockPoolOptions Opts(const ShmPath& p, uint64_t slots = 8) {
  return BlockPoolOptions{.path = p.path(), .block_bytes = kBlock, .num_slots = slots};
}

TEST(BlockPool, SlotsArePageAlignedAndDistinct) {
  ShmPath p;
  auto pool = BlockPool::Create(Opts(p));
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_EQ((*pool)->free_slots(), 8u);
  std::set<uint32_t> seen;
  for (int i = 0; i < 8; ++i) {
    auto s = (*pool)->Allocate();
    ASSERT_TRUE(s.has_value());
    EXPECT_EQ(reinterpret_cast<uintptr_t>((*pool)->data(*s)) % 4096, 0u);
    seen.insert(*s);
  }
  EXPECT_EQ(seen.size(), 8u);
  EXPECT_FALSE((*pool)->Allocate().has_value());
}

TEST(BlockPool, CommittedBlocksSurviveReopen) {
  ShmPath p;
  {
    auto pool = BlockPool::Create(Opts(p));
    ASSERT_TRUE(pool.ok());
    for (uint64_t i = 0; i < 3; ++i) {
      uint32_t s = *(*pool)->Allocate();
      auto data = Pattern(Key(i), kBlock - i);
      std::memcpy((*pool)->data(s), data.data(), data.size());
      (*pool)->Commit(s, Key(i), data.size(), 10 + i);
    }
    (*pool)->Allocate();  // a slot caught mid-write when the owner goes away
  }
  auto pool = BlockPool::Create(Opts(p));
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  const auto& rec = (*pool)->recovered();
  ASSERT_EQ(rec.size(), 3u);
  for (uint64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(rec[i].key, Key(i));  // oldest first
    EXPECT_EQ(rec[i].length, kBlock - i);
    auto want = Pattern(Key(i), kBlock - i);
    EXPECT_EQ(std::memcmp((*pool)->data(rec[i].slot), want.data(), want.size()), 0);
  }
  EXPECT_EQ((*pool)->free_slots(), 5u);  // the torn slot was freed
}

TEST(BlockPool, GeometryMustMatchOnReopen) {
  ShmPath p;
  { ASSERT_TRUE(BlockPool::Create(Opts(p)).ok()); }
  auto wrong = BlockPool::Create(Opts(p, 16));
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(wrong.status().message().find("holds 8 slots"), std::string::npos);
  auto any = BlockPool::Create({.path = p.path()});  // zero geometry adopts the file's
  ASSERT_TRUE(any.ok());
  EXPECT_EQ((*any)->num_slots(), 8u);
}

TEST(BlockPool, OneOwnerAtATime) {
  ShmPath p;
  auto first = BlockPool::Create(Opts(p));
  ASSERT_TRUE(first.ok());
  auto second = BlockPool::Create(Opts(p));
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(second.status().message().find("owned by another process"), std::string::npos);
}

TEST(BlockPool, RejectsBadGeometryAndForeignFiles) {
  ShmPath p;
  auto bad = BlockPool::Create({.path = p.path(), .block_bytes = 1000, .num_slots = 4});
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  { std::ofstream(p.path()) << "this is not a pool, just some text that is long enough to look like a header"; }
  ASSERT_EQ(::chmod(p.path().c_str(), 0600), 0);
  auto foreign = BlockPool::Create(Opts(p));
  ASSERT_FALSE(foreign.ok());
  EXPECT_NE(foreign.status().message().find("not a tpusync pool"), std::string::npos);
}

// A pool file another local user could open (pre-created with mode 0666, or a symlink to
// one of theirs) would hand them every block: it is refused, and the message says what to do.
TEST(BlockPool, RefusesAPoolFileOthersCanOpenAndSymlinks) {
  ShmPath p;
  {
    UniqueFd fd(::open(p.path().c_str(), O_RDWR | O_CREAT | O_EXCL, 0600));
    ASSERT_TRUE(fd.valid());
    ASSERT_EQ(::fchmod(fd.get(), 0666), 0);
  }
  auto open = BlockPool::Create(Opts(p));
  ASSERT_FALSE(open.ok());
  EXPECT_EQ(open.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(open.status().message().find("mode 0666"), std::string::npos) << open.status().message();
  EXPECT_NE(open.status().message().find("remove the file"), std::string::npos) << open.status().message();

  ShmPath link;
  ASSERT_EQ(::chmod(p.path().c_str(), 0600), 0);
  ASSERT_EQ(::symlink(p.path().c_str(), link.path().c_str()), 0);
  auto through = BlockPool::Create(Opts(link));
  ASSERT_FALSE(through.ok());
  EXPECT_NE(through.status().message().find("symbolic link"), std::string::npos) << through.status().message();
  struct stat st{};
  ASSERT_EQ(::stat(p.path().c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 0);  // the target was not initialised
}

TEST(BlockPool, ConcurrentAllocateAndFreeKeepEverySlot) {
  ShmPath p;
  auto pool = BlockPool::Create(Opts(p, 64));
  ASSERT_TRUE(pool.ok());
  std::vector<std::thread> threads;
  threads.reserve(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        if (auto s = (*pool)->Allocate()) (*pool)->Free(*s);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ((*pool)->free_slots(), 64u);
}

}  // namespace
}  // namespace tpusync
