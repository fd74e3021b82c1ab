#include "store/block_index.h"

#include <gtest/gtest.h>

#include "test_util.h"

namespace tpusync {
namespace {

using testing::Key;

TEST(BlockIndex, DramVictimIsLeastRecentlyUsed) {
  BlockIndex idx;
  for (uint32_t i = 0; i < 3; ++i) idx.SetDram(idx.Insert(Key(i)), i);
  EXPECT_EQ(idx.DramVictim()->key, Key(0));
  idx.TouchDram(*idx.Find(Key(0)));
  EXPECT_EQ(idx.DramVictim()->key, Key(1));
  EXPECT_EQ(idx.dram_blocks(), 3u);
}

TEST(BlockIndex, NeverPicksPinnedOrBusyBlocks) {
  struct Case {
    const char* name;
    void (*make_busy)(IndexEntry&);
  };
  const Case cases[] = {
      {"pinned", [](IndexEntry& e) { e.pins = 1; }},
      {"being read", [](IndexEntry& e) { e.dram_readers = 1; }},
      {"being demoted", [](IndexEntry& e) { e.demoting = true; }},
      {"being promoted", [](IndexEntry& e) { e.promoting = true; }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    BlockIndex idx;
    for (uint32_t i = 0; i < 2; ++i) idx.SetDram(idx.Insert(Key(i)), i);
    c.make_busy(*idx.Find(Key(0)));
    ASSERT_NE(idx.DramVictim(), nullptr);
    EXPECT_EQ(idx.DramVictim()->key, Key(1));
    c.make_busy(*idx.Find(Key(1)));
    EXPECT_EQ(idx.DramVictim(), nullptr);
  }
}

TEST(BlockIndex, TiersAndDiskVictims) {
  BlockIndex idx;
  IndexEntry& a = idx.Insert(Key(1));
  idx.SetDisk(a, 7);
  EXPECT_EQ(a.tier(), Tier::kDisk);
  idx.SetDram(a, 3);
  EXPECT_EQ(a.tier(), Tier::kDramAndDisk);
  IndexEntry& b = idx.Insert(Key(2));
  idx.SetDisk(b, 8);
  EXPECT_EQ(idx.DiskVictim()->key, Key(1));
  a.pins = 1;
  EXPECT_EQ(idx.DiskVictim()->key, Key(2));
  b.disk_readers = 1;
  EXPECT_EQ(idx.DiskVictim(), nullptr);
  idx.ClearDram(a);
  EXPECT_EQ(a.tier(), Tier::kDisk);
  idx.Erase(Key(1));
  EXPECT_EQ(idx.Find(Key(1)), nullptr);
  EXPECT_EQ(idx.disk_blocks(), 1u);
  EXPECT_EQ(idx.dram_blocks(), 0u);
}

TEST(BlockIndex, WritingBlockIsNotPresent) {
  BlockIndex idx;
  IndexEntry& e = idx.Insert(Key(1));
  e.writing = true;
  e.slot = 0;
  EXPECT_EQ(e.tier(), Tier::kNone);
}

}  // namespace
}  // namespace tpusync
