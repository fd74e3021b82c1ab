#include "store/shared_tier.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>
#include <unordered_set>

#include "base/posix_io.h"
#include "shared_tier_testing.h"
#include "test_util.h"
#include "tpusync/store.h"

namespace tpusync {
namespace {

using namespace testing;  // NOLINT(google-build-using-namespace): the tests' own helpers

TEST(SharedTier, ABlockOneHostWroteIsReadByAnother) {
  TempDir d;
  auto a = Open(d), b = Open(d);
  ASSERT_TRUE(WriteBlock(*a, 1, 5000).ok());
  EXPECT_TRUE(b->Exists(Key(1)));
  EXPECT_TRUE(ReadBlock(*b, 1, 5000).ok());
  EXPECT_EQ(b->Stats().hits, 1u);
  // Writing it again is a no-op, on any host.
  ASSERT_TRUE(WriteBlock(*b, 1, 5000).ok());
  EXPECT_EQ(b->Stats().write_dedup, 1u);
  EXPECT_EQ(ReadBlock(*b, 2).code(), StatusCode::kNotFound);
  // Nothing is left in the temporary directory.
  EXPECT_TRUE(std::filesystem::is_empty(a->root() + "/tmp"));
}

TEST(SharedTier, EnginesOfAnotherLayoutNeverSeeTheBlocks) {
  TempDir d;
  auto rank0 = Open(d, "model=m;tp=2;rank=0"), rank1 = Open(d, "model=m;tp=2;rank=1");
  ASSERT_TRUE(WriteBlock(*rank0, 1).ok());
  EXPECT_NE(rank0->root(), rank1->root());
  EXPECT_FALSE(rank1->Exists(Key(1)));
  EXPECT_EQ(ReadBlock(*rank1, 1).code(), StatusCode::kNotFound);
  // The block size is part of the fingerprint too.
  auto other = SharedTier::Open({.dir = d.path(), .secret = kSecret, .layout = "model=m;tp=2;rank=0", .block_bytes = 2 * kBlock,
                                 .run_evictor = false});
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE((*other)->Exists(Key(1)));
}

TEST(SharedTier, DamagedFilesAreMissesAndRemoved) {
  TempDir d;
  auto t = Open(d);
  for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(WriteBlock(*t, i).ok());
  {  // a flipped payload byte
    int fd = ::open(FileOf(*t, 0).c_str(), O_RDWR);
    unsigned char byte = 0;
    ASSERT_EQ(::pread(fd, &byte, 1, 4096 + 100), 1);
    byte ^= 0x01;
    ASSERT_EQ(::pwrite(fd, &byte, 1, 4096 + 100), 1);
    ::close(fd);
  }
  ASSERT_EQ(::truncate(FileOf(*t, 1).c_str(), 4096 + 100), 0);  // truncated
  ASSERT_EQ(::truncate(FileOf(*t, 2).c_str(), 10), 0);          // torn inside the header
  std::filesystem::copy_file(FileOf(*t, 3), FileOf(*t, 7));     // another block's bytes under this name
  for (uint64_t i : {0, 1, 2, 7}) {
    EXPECT_EQ(ReadBlock(*t, i).code(), StatusCode::kDataLoss) << i;
    EXPECT_FALSE(std::filesystem::exists(FileOf(*t, i))) << i;
  }
  EXPECT_EQ(t->Stats().corruptions, 4u);
  EXPECT_TRUE(ReadBlock(*t, 3).ok());
}

TEST(SharedTier, EvictsTheLeastRecentlyReadOfEveryHostDownToTheLowWatermark) {
  TempDir d;
  auto a = Open(d, "model=m;tp=1;rank=0", 10 * kFileBytes), b = Open(d, "model=m;tp=1;rank=0", 10 * kFileBytes);
  for (uint64_t i = 0; i < 9; ++i) ASSERT_TRUE(WriteBlock(i % 2 ? *a : *b, i).ok());
  for (uint64_t i = 0; i < 9; ++i) SetAtime(FileOf(*a, i), 1000 + static_cast<time_t>(i));
  ASSERT_TRUE(ReadBlock(*b, 0).ok());  // block 0 is now the most recently read
  // 9 files of 10 are over 0.85: one pass on host a deletes the oldest down to 0.70, i.e. 7 files.
  Result<uint64_t> evicted = a->EvictOnce();
  ASSERT_TRUE(evicted.ok());
  EXPECT_EQ(*evicted, 2u);
  EXPECT_FALSE(a->Exists(Key(1)));
  EXPECT_FALSE(a->Exists(Key(2)));
  for (uint64_t i : {0, 3, 4, 5, 6, 7, 8}) EXPECT_TRUE(a->Exists(Key(i))) << i;
  // Another host's pass at the same time finds nothing more to do.
  Result<uint64_t> again = b->EvictOnce();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, 0u);
  EXPECT_EQ(a->Stats().used_bytes, 7 * kFileBytes);
}

TEST(SharedTier, APinnedBlockSurvivesEveryHostsEvictor) {
  TempDir d;
  auto a = Open(d, "l", 4 * kFileBytes), b = Open(d, "l", 4 * kFileBytes);
  for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(WriteBlock(*a, i).ok());
  for (uint64_t i = 0; i < 4; ++i) SetAtime(FileOf(*a, i), 1000 + static_cast<time_t>(i));
  ASSERT_TRUE(b->Pin(Key(0)).ok());  // the oldest, pinned by host b for a load
  EXPECT_EQ(a->Pin(Key(9)).code(), StatusCode::kNotFound);
  ASSERT_TRUE(a->EvictOnce().ok());  // 4 of 4 over 0.85: down to 2.8 files
  EXPECT_TRUE(a->Exists(Key(0)));
  EXPECT_EQ(a->Stats().pins_spared, 1u);  // pinned before the pass: never taken aside
  EXPECT_EQ(a->Stats().evictions, 2u);
  EXPECT_TRUE(ReadBlock(*b, 0).ok());
  b->Release(Key(0));
  SetAtime(FileOf(*a, 0), 999);
  ASSERT_TRUE(WriteBlock(*a, 5).ok());
  ASSERT_TRUE(WriteBlock(*a, 6).ok());
  ASSERT_TRUE(a->EvictOnce().ok());
  EXPECT_FALSE(a->Exists(Key(0)));
}

TEST(SharedTier, AReadOfAPinnedBlockWaitsForAnEvictorToPutItBack) {
  // An evictor took the block aside before it saw the pin (the pin came during its pass); it
  // puts the block back once it reads the markers. A read on the pinning host meanwhile waits,
  // where an unpinned read is a miss at once.
  TempDir d;
  auto a = Open(d, "l"), b = Open(d, "l");
  ASSERT_TRUE(WriteBlock(*a, 0).ok());
  ASSERT_TRUE(WriteBlock(*a, 1).ok());
  ASSERT_TRUE(b->Pin(Key(0)).ok());
  const std::string aside0 = a->root() + "/tmp/" + Key(0).ToHex() + ".evict.test";
  const std::string aside1 = a->root() + "/tmp/" + Key(1).ToHex() + ".evict.test";
  ASSERT_EQ(::rename(FileOf(*a, 0).c_str(), aside0.c_str()), 0);
  ASSERT_EQ(::rename(FileOf(*a, 1).c_str(), aside1.c_str()), 0);
  EXPECT_EQ(ReadBlock(*b, 1).code(), StatusCode::kNotFound);  // not pinned: a miss
  std::jthread evictor([&] {  // reads the markers a little later, and puts the pinned one back
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ASSERT_EQ(::rename(aside0.c_str(), FileOf(*a, 0).c_str()), 0);
  });
  EXPECT_TRUE(ReadBlock(*b, 0).ok());
  evictor.join();
  b->Release(Key(0));
}

TEST(SharedTier, AFullTierEvictsToWriteAndRefusesCleanlyWhenAllIsPinned) {
  TempDir d;
  auto t = Open(d, "l", 2 * kFileBytes);
  ASSERT_TRUE(WriteBlock(*t, 0).ok());
  ASSERT_TRUE(WriteBlock(*t, 1).ok());
  SetAtime(FileOf(*t, 0), 1000);
  ASSERT_TRUE(WriteBlock(*t, 2).ok());  // at capacity: the least recently read makes room
  EXPECT_FALSE(t->Exists(Key(0)));
  ASSERT_TRUE(t->Pin(Key(1)).ok());
  ASSERT_TRUE(t->Pin(Key(2)).ok());
  EXPECT_EQ(WriteBlock(*t, 3).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(t->Stats().refused_full, 1u);
  EXPECT_FALSE(t->Exists(Key(3)));
  EXPECT_TRUE(t->Exists(Key(1)) && t->Exists(Key(2)));
  EXPECT_TRUE(std::filesystem::is_empty(t->root() + "/tmp"));
}

TEST(SharedTier, RemovesWhatADeadWriterLeft) {
  TempDir d;
  auto t = Open(d);
  const std::string orphan = t->root() + "/tmp/" + Key(1).ToHex() + ".dead.1";
  { std::ofstream(orphan) << "half a block"; }
  const timespec old[2] = {{1000, 0}, {1000, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, orphan.c_str(), old, 0), 0);
  const std::string fresh = t->root() + "/tmp/" + Key(2).ToHex() + ".alive.1";
  { std::ofstream(fresh) << "being written"; }
  ASSERT_TRUE(t->EvictOnce().ok());
  EXPECT_FALSE(std::filesystem::exists(orphan));
  EXPECT_TRUE(std::filesystem::exists(fresh));
  EXPECT_FALSE(t->Exists(Key(1)));
}

TEST(SharedTier, BufferedIoWhenDirectIoIsOff) {
  // Filesystems that refuse O_DIRECT (FUSE) are probed at open: tests/integration/shared.
  TempDir d;
  auto t = SharedTier::Open({.dir = d.path(), .secret = kSecret, .layout = "l", .block_bytes = kBlock, .direct_io = false,
                             .run_evictor = false});
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_FALSE((*t)->direct_io());
  EXPECT_FALSE((*t)->Stats().direct_io);
  EXPECT_TRUE(WriteBlock(**t, 1, 100).ok());
  EXPECT_TRUE(ReadBlock(**t, 1, 100).ok());
}

std::span<const std::byte> Bytes(const std::string& s) { return std::as_bytes(std::span(s)); }

TEST(SharedTier, ARecordIsReadByEveryHostAndLeavesWithItsBlock) {
  TempDir d;
  auto a = Open(d, "l", 4 * kFileBytes), b = Open(d, "l", 4 * kFileBytes), other = Open(d, "other");
  ASSERT_TRUE(a->Describe(Key(1), Bytes("tokens of block 1")).ok());  // before the block: kept
  ASSERT_TRUE(WriteBlock(*a, 1).ok());
  EXPECT_EQ(b->Record(Key(1)), "tokens of block 1");
  EXPECT_EQ(other->Record(Key(1)), "");  // another layout's engines never see it
  ASSERT_TRUE(b->Describe(Key(1), Bytes("another description")).ok());  // written once
  EXPECT_EQ(a->Record(Key(1)), "tokens of block 1");
  EXPECT_EQ(a->Describe(Key(2), {}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a->Describe(Key(2), Bytes(std::string(kMaxRecordBytes + 1, 'x'))).code(), StatusCode::kInvalidArgument);
  // Evicted (the tier over its watermark): the record goes with the block.
  for (uint64_t i = 2; i < 5; ++i) ASSERT_TRUE(WriteBlock(*a, i).ok());
  SetAtime(FileOf(*a, 1), 1000);
  ASSERT_TRUE(b->EvictOnce().ok());
  EXPECT_FALSE(a->Exists(Key(1)));
  EXPECT_EQ(a->Record(Key(1)), "");
  EXPECT_FALSE(std::filesystem::exists(a->root() + "/records/" + Key(1).ToHex().substr(0, 2) + "/" + Key(1).ToHex()));
}

TEST(SharedTier, ADamagedRecordReadsAsNoneAndIsRemoved) {
  TempDir d;
  auto a = Open(d);
  ASSERT_TRUE(WriteBlock(*a, 1).ok());
  ASSERT_TRUE(a->Describe(Key(1), Bytes("parent and tokens")).ok());
  const std::string hex = Key(1).ToHex();
  const std::string path = a->root() + "/records/" + hex.substr(0, 2) + "/" + hex;
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('X');
  }
  EXPECT_EQ(a->Record(Key(1)), "");
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_EQ(a->Stats().corruptions, 1u);
  EXPECT_TRUE(a->Describe(Key(1), Bytes("parent and tokens")).ok());  // described again
  EXPECT_EQ(a->Record(Key(1)), "parent and tokens");
  ::truncate(path.c_str(), 10);
  EXPECT_EQ(a->Record(Key(1)), "");
}

TEST(SharedTier, EachScanReportsWhatOtherHostsPublishedAndRemoved) {
  TempDir d;
  std::mutex m;
  std::vector<BlockKey> seen;
  auto b = SharedTier::Open({.dir = d.path(), .secret = kSecret, .layout = "l", .block_bytes = kBlock, .run_evictor = false,
                             .on_changed = [&](const BlockKey& k) {
                               std::lock_guard lock(m);
                               seen.push_back(k);
                             }});
  ASSERT_TRUE(b.ok());
  auto a = Open(d, "l");
  ASSERT_TRUE(WriteBlock(*a, 1).ok());
  ASSERT_TRUE(WriteBlock(*a, 2).ok());
  ASSERT_TRUE((*b)->EvictOnce().ok());
  std::unordered_set<BlockKey, BlockKeyHash> got(seen.begin(), seen.end());
  EXPECT_EQ(got, (std::unordered_set<BlockKey, BlockKeyHash>{Key(1), Key(2)}));
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_EQ((*b)->Stats().blocks, 2u);
  // Most recently read first.
  SetAtime(FileOf(*a, 1), 1000);
  SetAtime(FileOf(*a, 2), 2000);
  ASSERT_TRUE((*b)->EvictOnce().ok());
  EXPECT_EQ((*b)->Catalog(10), (std::vector<BlockKey>{Key(2), Key(1)}));
  EXPECT_EQ((*b)->Catalog(1), (std::vector<BlockKey>{Key(2)}));
  seen.clear();
  ASSERT_TRUE((*b)->EvictOnce().ok());
  EXPECT_TRUE(seen.empty());  // nothing changed
  ASSERT_EQ(::unlink(FileOf(*a, 2).c_str()), 0);  // another host's evictor
  ASSERT_TRUE((*b)->EvictOnce().ok());
  EXPECT_EQ(seen, std::vector<BlockKey>{Key(2)});
  EXPECT_EQ((*b)->Catalog(10), std::vector<BlockKey>{Key(1)});
}

TEST(SharedTier, ARecordWhoseBlockNeverCameIsRemovedAfterThePinTtl) {
  TempDir d;
  auto t = SharedTier::Open({.dir = d.path(), .secret = kSecret, .layout = "l", .block_bytes = kBlock,
                             .pin_ttl = std::chrono::milliseconds(1000), .run_evictor = false});
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->Describe(Key(7), Bytes("never stored")).ok());
  ASSERT_TRUE((*t)->Describe(Key(8), Bytes("stored")).ok());
  ASSERT_TRUE(WriteBlock(**t, 8).ok());
  auto sweep = [&] {  // a pass checks one of the 256 record directories
    for (int i = 0; i < 256; ++i) ASSERT_TRUE((*t)->EvictOnce().ok());
  };
  sweep();
  EXPECT_EQ((*t)->Record(Key(7)), "never stored");  // younger than the ttl: its block may be on its way
  for (uint64_t i : {7, 8}) {
    const std::string hex = Key(i).ToHex();
    const timespec old[2] = {{1000, 0}, {1000, 0}};
    ASSERT_EQ(::utimensat(AT_FDCWD, ((*t)->root() + "/records/" + hex.substr(0, 2) + "/" + hex).c_str(), old, 0), 0);
  }
  sweep();
  EXPECT_EQ((*t)->Record(Key(7)), "");
  EXPECT_EQ((*t)->Record(Key(8)), "stored");
}

// ---- through the Store -----------------------------------------------------------------

StoreOptions StoreOpts(const ShmPath& pool, const TempDir& shared, SharedPolicy policy, uint32_t slots = 8) {
  StoreOptions o;
  o.pool = {.path = pool.path(), .block_bytes = kBlock, .num_slots = slots};
  o.shared_enabled = true;
  o.shared = {.dir = shared.path(), .secret = kSecret, .layout = "l", .run_evictor = false};
  o.shared_policy = policy;
  return o;
}

Status PutOne(Store& s, uint64_t i) {
  auto data = Pattern(Key(i), kBlock);
  ConstBuffer in{data.data(), data.size()};
  const BlockKey k = Key(i);
  return s.Put(std::span(&k, 1), std::span(&in, 1));
}

Tier TierOf(Store& s, uint64_t i) {
  const BlockKey k = Key(i);
  return s.Lookup(std::span(&k, 1), false).tiers[0];
}

std::vector<std::byte> GetOne(Store& s, uint64_t i, bool* found) {
  const BlockKey k = Key(i);
  std::vector<std::byte> out(kBlock);
  MutableBuffer b{out.data(), out.size()};
  uint8_t f = 0;
  EXPECT_TRUE(s.Get(std::span(&k, 1), std::span(&b, 1), std::span(&f, 1)).ok());
  *found = f != 0;
  return out;
}

// Two hosts' stores on one shared directory; host a has stored (and written through) block 1.
struct TwoHosts {
  TempDir shared;
  ShmPath pool_a, pool_b;
  std::unique_ptr<Store> a, b;

  TwoHosts() {
    auto sa = Store::Open(StoreOpts(pool_a, shared, SharedPolicy::kWriteThrough));
    auto sb = Store::Open(StoreOpts(pool_b, shared, SharedPolicy::kWriteThrough));
    EXPECT_TRUE(sa.ok() && sb.ok());
    a = std::move(*sa);
    b = std::move(*sb);
    EXPECT_TRUE(PutOne(*a, 1).ok());
    EXPECT_TRUE(a->Flush().ok());
  }
};

TEST(SharedTierStore, WriteThroughMakesEveryPutReadableOnAFreshHost) {
  TwoHosts h;
  auto& b = h.b;
  EXPECT_EQ(TierOf(*b, 1), Tier::kShared);
  bool found = false;
  EXPECT_EQ(GetOne(*b, 1, &found), Pattern(Key(1), kBlock));
  EXPECT_TRUE(found);
  StoreStats st = b->Stats();
  EXPECT_EQ(st.hits_shared, 1u);
  EXPECT_EQ(st.shared.hits, 1u);
  // Promoted into b's DRAM: the next read is a DRAM hit.
  EXPECT_EQ(TierOf(*b, 1), Tier::kDram);
}

TEST(SharedTierStore, DemotionWritesBlocksLeavingDram) {
  TempDir shared;
  ShmPath pool;
  auto s = Store::Open(StoreOpts(pool, shared, SharedPolicy::kDemote, 4));
  ASSERT_TRUE(s.ok());
  for (uint64_t i = 0; i < 12; ++i) {
    ASSERT_TRUE(PutOne(**s, i).ok());
  }
  ASSERT_TRUE((*s)->Flush().ok());
  StoreStats st = (*s)->Stats();
  EXPECT_GE(st.shared.writes, 8u);  // at least the blocks that left the 4 slots
  EXPECT_EQ(st.dropped, 0u);
  for (uint64_t i = 0; i < 12; ++i) {
    bool found = false;
    EXPECT_EQ(GetOne(**s, i, &found), Pattern(Key(i), kBlock)) << i;
    EXPECT_TRUE(found) << i;
  }
}

TEST(SharedTierStore, WhereAsksTheSharedTierAboutEveryKeyLookupOnlyThePrefix) {
  TwoHosts h;
  BlockKey keys[3] = {Key(2), Key(1), Key(3)};  // absent, on the tier, absent
  EXPECT_EQ(h.b->Lookup(keys, false).tiers, (std::vector<Tier>{Tier::kNone, Tier::kNone, Tier::kNone}));
  EXPECT_EQ(h.b->Where(keys), (std::vector<Tier>{Tier::kNone, Tier::kShared, Tier::kNone}));
  EXPECT_EQ(h.a->Where(keys), (std::vector<Tier>{Tier::kNone, Tier::kDram, Tier::kNone}));
}

TEST(SharedTierStore, RecordsByKeyAndTheCatalog) {
  TwoHosts h;
  BlockKey one = Key(1);
  std::string record = "block 1";
  ASSERT_TRUE(h.a->Describe(std::span(&one, 1), std::span(&record, 1)).ok());
  BlockKey keys[2] = {Key(1), Key(2)};
  Result<SharedRecords> r = h.b->Records(keys, 10);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->records, (std::vector<std::string>{"block 1", ""}));
  // A host started later finds the block in its first scan: the catalog.
  ShmPath pool_c;
  auto c = Store::Open(StoreOpts(pool_c, h.shared, SharedPolicy::kWriteThrough));
  ASSERT_TRUE(c.ok());
  Result<SharedRecords> all = (*c)->Records({}, 10);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->keys, std::vector<BlockKey>{Key(1)});
  EXPECT_EQ(all->records, std::vector<std::string>{"block 1"});
}

TEST(SharedTierStore, AnotherHostsBlockReachesTheChangeFeedAtTheNextScan) {
  TempDir shared;
  ShmPath pool_a, pool_b;
  StoreOptions ob = StoreOpts(pool_b, shared, SharedPolicy::kWriteThrough);
  ob.shared.run_evictor = true;
  ob.shared.evict_interval = std::chrono::milliseconds(20);
  auto b = Store::Open(ob);
  auto a = Store::Open(StoreOpts(pool_a, shared, SharedPolicy::kWriteThrough));
  ASSERT_TRUE(a.ok() && b.ok());
  ChangeCursor cursor = (*b)->Changes({}, std::chrono::milliseconds(0), 10).next;
  ASSERT_TRUE(PutOne(**a, 5).ok());
  ASSERT_TRUE((*a)->Flush().ok());
  ChangeBatch got = (*b)->Changes(cursor, std::chrono::milliseconds(10000), 10);
  EXPECT_FALSE(got.lost);
  EXPECT_EQ(got.keys, std::vector<BlockKey>{Key(5)});
}

TEST(SharedTierStore, NoSharedTierNoRecords) {
  ShmPath pool;
  StoreOptions o;
  o.pool = {.path = pool.path(), .block_bytes = kBlock, .num_slots = 2};
  auto s = Store::Open(o);
  ASSERT_TRUE(s.ok());
  BlockKey k = Key(1);
  std::string record = "x";
  EXPECT_EQ((*s)->Describe(std::span(&k, 1), std::span(&record, 1)).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*s)->Records({}, 1).status().code(), StatusCode::kFailedPrecondition);
}

TEST(SharedTierStore, APinnedSharedBlockIsPinnedOnTheTier) {
  TwoHosts h;
  auto& b = h.b;
  BlockKey keys[2] = {Key(1), Key(2)};
  LookupResult r = b->Lookup(keys, true);
  EXPECT_EQ(r.prefix_len, 1u);
  EXPECT_EQ(r.tiers[0], Tier::kShared);
  EXPECT_EQ(b->Stats().pinned, 1u);
  std::string pins = h.shared.path() + "/tpusync-shared-v2";
  size_t markers = 0;
  for (auto& pool : std::filesystem::directory_iterator(pins)) {
    for (auto& layout : std::filesystem::directory_iterator(pool.path())) {
      for (auto& m : std::filesystem::directory_iterator(layout.path() / "pins")) markers += m.is_regular_file();
    }
  }
  EXPECT_EQ(markers, 1u);
  ASSERT_TRUE(b->Release(std::span(keys, 1)).ok());
  EXPECT_EQ(b->Stats().pinned, 0u);
  EXPECT_EQ(b->Stats().blocks, 0u);
  EXPECT_EQ(b->Pin(keys).code(), StatusCode::kNotFound);  // key 2 is nowhere
}

}  // namespace
}  // namespace tpusync
