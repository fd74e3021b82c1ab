#include "tpusync/store.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <optional>
#include <thread>

#include "store/change_feed.h"
#include "test_util.h"

namespace tpusync {
namespace {

using namespace testing;  // NOLINT(google-build-using-namespace): the tests' own helpers

class StoreTest : public ::testing::Test {
 protected:
  StoreOptions Opts(uint64_t dram_blocks, uint64_t disk_blocks = 0) {
    StoreOptions o;
    o.pool = {.path = shm_.path(), .block_bytes = kBlock, .num_slots = dram_blocks};
    o.disk_enabled = disk_blocks > 0;
    o.disk = {.dir = dir_.path(), .capacity_bytes = disk_blocks * kBlock};
    return o;
  }
  std::unique_ptr<Store> Open(uint64_t dram_blocks, uint64_t disk_blocks = 0) {
    auto s = Store::Open(Opts(dram_blocks, disk_blocks));
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(s).value() : nullptr;
  }
  // Puts blocks [first, first+n) with their patterns.
  static void PutRange(Store& s, uint64_t first, uint64_t n, uint64_t size = kBlock) {
    for (uint64_t i = first; i < first + n; ++i) {
      auto data = Pattern(Key(i), size);
      BlockKey k = Key(i);
      ConstBuffer b{data.data(), data.size()};
      Status st = s.Put({&k, 1}, {&b, 1});
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
  }
  // Gets one block; true if found with exactly its pattern.
  static bool GetMatches(Store& s, uint64_t i, uint64_t size = kBlock) {
    std::vector<std::byte> out(size);  // a block fills its buffer or is not found
    BlockKey k = Key(i);
    MutableBuffer b{out.data(), out.size()};
    uint8_t found = 0;
    Status st = s.Get({&k, 1}, {&b, 1}, {&found, 1});
    EXPECT_TRUE(st.ok()) << st.ToString();
    return found && std::memcmp(out.data(), Pattern(k, size).data(), size) == 0;
  }
  // A store holding blocks [0, n) of `size` bytes, its write-behind done.
  std::unique_ptr<Store> OpenFlushed(uint64_t dram_blocks, uint64_t disk_blocks, uint64_t n, uint64_t size = kBlock) {
    auto s = Open(dram_blocks, disk_blocks);
    PutRange(*s, 0, n, size);
    Status st = s->Flush();
    EXPECT_TRUE(st.ok()) << st.ToString();
    return s;
  }
  static std::vector<BlockKey> Keys(uint64_t first, uint64_t n) {
    std::vector<BlockKey> v;
    for (uint64_t i = first; i < first + n; ++i) v.push_back(Key(i));
    return v;
  }

  ShmPath shm_;
  TempDir dir_;
};

TEST_F(StoreTest, PutGetLookupInDram) {
  auto s = Open(8);
  PutRange(*s, 0, 3);
  for (uint64_t i = 0; i < 3; ++i) EXPECT_TRUE(GetMatches(*s, i));
  EXPECT_FALSE(GetMatches(*s, 99));
  auto keys = Keys(0, 5);
  keys[3] = Key(42);
  LookupResult r = s->Lookup(keys, false);
  EXPECT_EQ(r.prefix_len, 3u);
  EXPECT_EQ(r.tiers[0], Tier::kDram);
  EXPECT_EQ(r.tiers[3], Tier::kNone);
  StoreStats st = s->Stats();
  EXPECT_EQ(st.puts, 3u);
  EXPECT_EQ(st.hits_dram, 3u);
  EXPECT_EQ(st.misses, 1u);
}

TEST_F(StoreTest, PutOfAPresentKeyIsADedup) {
  auto s = Open(4);
  PutRange(*s, 0, 1);
  PutRange(*s, 0, 1);
  EXPECT_EQ(s->Stats().puts, 1u);
  EXPECT_EQ(s->Stats().put_dedup, 1u);
  EXPECT_EQ(s->Stats().dram_used, 1u);
}

TEST_F(StoreTest, BadArgumentsAreRejectedWithoutSideEffects) {
  auto s = Open(4);
  std::vector<std::byte> big(kBlock + 1), small(10);
  BlockKey k = Key(1);
  ConstBuffer b{big.data(), big.size()};
  Status st = s->Put({&k, 1}, {&b, 1});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("buffer 0 holds 8193 bytes"), std::string::npos);
  EXPECT_EQ(s->Stats().dram_used, 0u);
  PutRange(*s, 1, 1);
  MutableBuffer out{small.data(), small.size()};
  uint8_t found = 1;
  EXPECT_EQ(s->Get({&k, 1}, {&out, 1}, {&found, 1}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(found, 0);
}

TEST_F(StoreTest, WithoutDiskTheLeastRecentlyUsedBlockIsDropped) {
  auto s = Open(4);
  PutRange(*s, 0, 4);
  EXPECT_TRUE(GetMatches(*s, 0));  // 0 is now the most recent; 1 is the LRU
  PutRange(*s, 4, 1);
  EXPECT_FALSE(GetMatches(*s, 1));
  EXPECT_TRUE(GetMatches(*s, 0));
  EXPECT_TRUE(GetMatches(*s, 4));
  EXPECT_EQ(s->Stats().evictions, 1u);
}

TEST_F(StoreTest, PinnedBlocksAreNeverEvicted) {
  auto s = Open(4);
  PutRange(*s, 0, 4);
  auto keys = Keys(0, 4);
  ASSERT_TRUE(s->Pin(keys).ok());
  std::vector<std::byte> data(kBlock);
  BlockKey k = Key(9);
  ConstBuffer b{data.data(), data.size()};
  Status st = s->Put({&k, 1}, {&b, 1});
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  for (uint64_t i = 0; i < 4; ++i) EXPECT_TRUE(GetMatches(*s, i));
  ASSERT_TRUE(s->Release({&keys[2], 1}).ok());
  EXPECT_TRUE(s->Put({&k, 1}, {&b, 1}).ok());
  EXPECT_EQ(s->Lookup(Keys(0, 4), false).tiers[2], Tier::kNone);
  EXPECT_EQ(s->Stats().pinned, 3u);
}

TEST_F(StoreTest, PinAndReleaseCheckEveryKeyFirst) {
  auto s = Open(4);
  PutRange(*s, 0, 2);
  std::vector<BlockKey> keys = {Key(0), Key(7)};
  Status st = s->Pin(keys);
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
  EXPECT_EQ(s->Stats().pinned, 0u);  // Key(0) was not pinned either
  keys = {Key(0), Key(0)};
  ASSERT_TRUE(s->Pin({keys.data(), 1}).ok());
  EXPECT_EQ(s->Release(keys).code(), StatusCode::kFailedPrecondition);  // pinned once, released twice
  EXPECT_TRUE(s->Release({keys.data(), 1}).ok());
  EXPECT_EQ(s->Release({keys.data(), 1}).code(), StatusCode::kFailedPrecondition);
}

TEST_F(StoreTest, LookupPinsThePrefixOnly) {
  auto s = Open(8);
  PutRange(*s, 0, 3);
  std::vector<BlockKey> keys = {Key(0), Key(1), Key(50), Key(2)};
  LookupResult r = s->Lookup(keys, true);
  EXPECT_EQ(r.prefix_len, 2u);
  EXPECT_EQ(r.tiers[3], Tier::kDram);
  EXPECT_EQ(s->Stats().pinned, 2u);
  EXPECT_TRUE(s->Release({keys.data(), 2}).ok());
  EXPECT_EQ(s->Release({&keys[3], 1}).code(), StatusCode::kFailedPrecondition);
}

TEST_F(StoreTest, OverflowIsWrittenBehindToDiskAndPromotedOnRead) {
  auto s = OpenFlushed(8, 64, 40);
  StoreStats st = s->Stats();
  EXPECT_GE(st.demotions, 32u);
  EXPECT_LE(st.dram_used, 8u);
  auto r = s->Lookup(Keys(0, 40), false);
  EXPECT_EQ(r.prefix_len, 40u);
  EXPECT_EQ(r.tiers[0], Tier::kDisk);
  for (uint64_t i = 0; i < 40; ++i) EXPECT_TRUE(GetMatches(*s, i)) << i;
  st = s->Stats();
  EXPECT_GE(st.promotions, 32u);
  EXPECT_EQ(st.hits_dram + st.hits_disk, 40u);
  EXPECT_EQ(s->Lookup(Keys(39, 1), false).tiers[0], Tier::kDramAndDisk);
}

TEST_F(StoreTest, BatchedGetReadsAheadFromDiskAndReturnsEveryByte) {
  auto s = OpenFlushed(32, 256, 200);  // 4 blocks of read-ahead with the default 2 io threads
  std::vector<BlockKey> keys = Keys(0, 200);
  std::vector<std::vector<std::byte>> out(200, std::vector<std::byte>(kBlock));
  std::vector<MutableBuffer> bufs;
  bufs.reserve(out.size());
  for (auto& o : out) bufs.push_back({o.data(), o.size()});
  std::vector<uint8_t> found(200);
  ASSERT_TRUE(s->Get(keys, bufs, found).ok());
  for (uint64_t i = 0; i < 200; ++i) {
    ASSERT_TRUE(found[i]) << i;
    EXPECT_EQ(out[i], Pattern(Key(i), kBlock)) << i;
  }
  EXPECT_GE(s->Stats().promotions, 160u);
}

TEST_F(StoreTest, DiskTierEvictsItsOwnLeastRecentlyUsed) {
  auto s = OpenFlushed(4, 8, 20);
  StoreStats st = s->Stats();
  EXPECT_LE(st.disk_used, 8u);
  EXPECT_GT(st.disk_evictions, 0u);
  EXPECT_FALSE(GetMatches(*s, 0));
  EXPECT_TRUE(GetMatches(*s, 19));
}

TEST_F(StoreTest, ExplicitEvictMovesDownOneTier) {
  auto s = Open(8, 8);
  PutRange(*s, 0, 2);
  auto keys = Keys(0, 2);
  ASSERT_TRUE(s->Evict({keys.data(), 1}).ok());
  EXPECT_EQ(s->Lookup(keys, false).tiers[0], Tier::kDisk);
  ASSERT_TRUE(s->Evict({keys.data(), 1}).ok());
  EXPECT_EQ(s->Lookup(keys, false).tiers[0], Tier::kNone);
  ASSERT_TRUE(s->Pin({&keys[1], 1}).ok());
  EXPECT_EQ(s->Evict({&keys[1], 1}).code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(GetMatches(*s, 1));
}

TEST_F(StoreTest, CorruptedDiskBlockIsAMissNeverWrongBytes) {
  auto s = Open(4, 8);
  PutRange(*s, 0, 1);
  auto k = Keys(0, 1);
  ASSERT_TRUE(s->Evict(k).ok());
  // Flip one payload byte of the only written extent (extent 0).
  std::string path = dir_.file("extents.dat");
  FILE* f = std::fopen(path.c_str(), "r+b");
  std::fseek(f, 4096 + 123, SEEK_SET);
  int c = std::fgetc(f);
  std::fseek(f, 4096 + 123, SEEK_SET);
  std::fputc(c ^ 0x01, f);
  std::fclose(f);
  EXPECT_FALSE(GetMatches(*s, 0));
  StoreStats st = s->Stats();
  EXPECT_EQ(st.corruptions, 1u);
  EXPECT_NE(st.last_error.find("checksum mismatch"), std::string::npos);
  EXPECT_EQ(s->Lookup(k, false).tiers[0], Tier::kNone);
  EXPECT_EQ(st.disk_used, 0u);
}

TEST_F(StoreTest, RestartRecoversDramAndDisk) {
  OpenFlushed(8, 32, 20, 5000);  // closed again at once
  auto s = Open(8, 32);
  StoreStats st = s->Stats();
  EXPECT_GT(st.recovered_dram, 0u);
  EXPECT_GT(st.recovered_disk, 0u);
  EXPECT_EQ(s->Lookup(Keys(0, 20), false).prefix_len, 20u);
  for (uint64_t i = 0; i < 20; ++i) EXPECT_TRUE(GetMatches(*s, i, 5000)) << i;
}

TEST_F(StoreTest, FullDiskIsReportedAndTheStoreKeepsServing) {
  std::filesystem::create_symlink("/dev/full", dir_.file("extents.dat"));
  auto s = Open(4, 16);
  PutRange(*s, 0, 12);
  Status st = s->Flush();
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("No space left"), std::string::npos);
  StoreStats stats = s->Stats();
  EXPECT_GT(stats.disk_write_errors, 0u);
  EXPECT_TRUE(GetMatches(*s, 11));  // the newest blocks are still served from DRAM
  EXPECT_TRUE(s->Flush().ok());     // the error was reported once
}

TEST_F(StoreTest, LeasesGiveZeroCopyAccessToSlots) {
  auto s = Open(4);
  auto w = s->Reserve(Key(5));
  ASSERT_TRUE(w.ok());
  auto data = Pattern(Key(5), kBlock);
  std::memcpy(w->data(), data.data(), kBlock);
  EXPECT_EQ(s->Lookup(Keys(5, 1), false).tiers[0], Tier::kNone);  // not visible until committed
  ASSERT_TRUE(w->Commit(kBlock).ok());
  EXPECT_EQ(w->Commit(kBlock).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s->Reserve(Key(5)).status().code(), StatusCode::kFailedPrecondition);
  auto r = s->Acquire(Key(5));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->data(), w->data());  // the very same bytes, no copy
  EXPECT_EQ(r->file_offset(), w->file_offset());
  EXPECT_EQ(s->Acquire(Key(6)).status().code(), StatusCode::kNotFound);
  {
    auto aborted = s->Reserve(Key(7));
    ASSERT_TRUE(aborted.ok());
  }
  EXPECT_EQ(s->Stats().dram_used, 1u);
}

TEST_F(StoreTest, ConcurrentWritersAndReadersSeeWholeBlocks) {
  auto s = Open(32, 256);
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  threads.reserve(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (uint64_t i = 0; i < 100; ++i) {
        uint64_t id = (i * 4 + t) % 150;  // overlapping keys across threads
        PutRange(*s, id, 1);
        if (!GetMatches(*s, id) && s->Lookup(Keys(id, 1), false).prefix_len == 1) ++bad;
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(s->Flush().ok());
  EXPECT_EQ(bad.load(), 0);
  for (uint64_t id = 0; id < 150; ++id) {
    if (s->Lookup(Keys(id, 1), false).prefix_len == 1) EXPECT_TRUE(GetMatches(*s, id)) << id;
  }
}

// ---- issue 14: an acknowledged write is readable, or the call fails ----------------------

void FlipByte(const std::string& path, long offset) {
  FILE* f = std::fopen(path.c_str(), "r+b");
  ASSERT_NE(f, nullptr);
  std::fseek(f, offset, SEEK_SET);
  int c = std::fgetc(f);
  std::fseek(f, offset, SEEK_SET);
  std::fputc(c ^ 0x01, f);
  std::fclose(f);
}

TEST_F(StoreTest, PutWaitsForAnotherWritersLeaseAndWritesWhenItAborts) {
  auto s = Open(4);
  std::optional<WriteLease> other;
  other.emplace(std::move(s->Reserve(Key(1))).value());
  // A non-waiting reservation of the same key is told it is busy, not "already stored".
  EXPECT_EQ(s->Reserve(Key(1), false).status().code(), StatusCode::kUnavailable);
  std::thread writer([&] { PutRange(*s, 1, 1); });  // waits for `other`
  ASSERT_TRUE(testing::Eventually([&] { return s->Stats().waiting_writers == 1; }));
  other.reset();  // the other writer gives up without committing
  writer.join();
  EXPECT_TRUE(GetMatches(*s, 1));
}

TEST_F(StoreTest, PutOfAKeyWhoseLeaseCommitsMeanwhileIsADedup) {
  auto s = Open(4);
  auto lease = std::move(s->Reserve(Key(2))).value();
  auto data = Pattern(Key(2), kBlock);
  std::memcpy(lease.data(), data.data(), kBlock);
  std::thread writer([&] { PutRange(*s, 2, 1); });
  ASSERT_TRUE(testing::Eventually([&] { return s->Stats().waiting_writers == 1; }));
  ASSERT_TRUE(lease.Commit(kBlock).ok());
  writer.join();
  EXPECT_TRUE(GetMatches(*s, 2));
  EXPECT_EQ(s->Stats().put_dedup, 1u);
}

TEST_F(StoreTest, PutFailsRatherThanAcknowledgeWhileAnotherLeaseHoldsTheKey) {
  StoreOptions o = Opts(4);
  o.write_wait = std::chrono::milliseconds(50);
  auto s = std::move(Store::Open(o)).value();
  auto lease = std::move(s->Reserve(Key(3))).value();
  auto data = Pattern(Key(3), kBlock);
  BlockKey k = Key(3);
  ConstBuffer b{data.data(), data.size()};
  EXPECT_EQ(s->Put({&k, 1}, {&b, 1}).code(), StatusCode::kUnavailable);
}

TEST_F(StoreTest, AReservationThatMustNotWaitForLeasesStillWaitsForWriteBehind) {
  auto s = Open(2, 8);
  PutRange(*s, 0, 2);  // DRAM full of blocks that are not on disk yet
  // A caller holding leases (wait = false) gets a slot once write-behind has freed one...
  std::vector<WriteLease> held;
  for (uint64_t k : {10, 11}) {
    Result<WriteLease> l = s->Reserve(Key(k), false);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    held.push_back(std::move(l).value());
  }
  // ...but a pool full of leases is reported at once, never waited for.
  EXPECT_EQ(s->Reserve(Key(12), false).status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(GetMatches(*s, 0));  // the blocks that made room are on disk
  EXPECT_TRUE(GetMatches(*s, 1));
}

TEST_F(StoreTest, AWriterWaitsForSlotsHeldByLeasesInsteadOfReportingPins) {
  auto s = Open(2);
  std::vector<WriteLease> held;
  for (uint64_t i = 0; i < 2; ++i) held.push_back(std::move(s->Reserve(Key(i))).value());
  // Without waiting, a full pool of leases is reported at once.
  EXPECT_EQ(s->Reserve(Key(10), false).status().code(), StatusCode::kResourceExhausted);
  std::optional<Result<WriteLease>> waiting;
  std::thread writer([&] { waiting.emplace(s->Reserve(Key(9))); });
  ASSERT_TRUE(testing::Eventually([&] { return s->Stats().waiting_writers == 1; }));
  for (auto& l : held) {
    std::memset(l.data(), 7, kBlock);
    ASSERT_TRUE(l.Commit(kBlock).ok());
  }
  writer.join();
  ASSERT_TRUE(waiting->ok()) << waiting->status().ToString();
}

TEST_F(StoreTest, APinnedBlockThatFailedVerificationCanBeWrittenAgain) {
  auto s = Open(4, 8);
  PutRange(*s, 0, 1);
  auto k = Keys(0, 1);
  ASSERT_TRUE(s->Evict(k).ok());
  ASSERT_TRUE(s->Pin(k).ok());
  FlipByte(dir_.file("extents.dat"), 4096 + 7);
  EXPECT_FALSE(GetMatches(*s, 0));
  EXPECT_EQ(s->Lookup(k, false).tiers[0], Tier::kNone);
  PutRange(*s, 0, 1);  // must store, not dedup against the empty entry
  EXPECT_TRUE(GetMatches(*s, 0));
  EXPECT_EQ(s->Lookup(k, false).tiers[0], Tier::kDram);
  ASSERT_TRUE(s->Release(k).ok());  // the pin survived the rewrite
  EXPECT_EQ(s->Stats().pinned, 0u);
  ASSERT_TRUE(s->Evict(k).ok());
  ASSERT_TRUE(s->Evict(k).ok());
  EXPECT_EQ(s->Reserve(Key(0)).ok(), true);  // and so can a lease
}

TEST_F(StoreTest, ABlockEvictedFromDiskStaysGoneAfterARestart) {
  {
    auto s = Open(4, 8);
    PutRange(*s, 0, 2);
    auto k = Keys(0, 2);
    ASSERT_TRUE(s->Evict(k).ok());  // to disk
    ASSERT_TRUE(s->Evict({k.data(), 1}).ok());  // block 0 off the disk too
    EXPECT_EQ(s->Lookup(k, false).tiers[0], Tier::kNone);
  }
  auto s = Open(4, 8);
  auto k = Keys(0, 2);
  EXPECT_EQ(s->Lookup(k, false).tiers[0], Tier::kNone);
  EXPECT_EQ(s->Lookup(k, false).tiers[1], Tier::kDisk);
  EXPECT_EQ(s->Stats().recovered_disk, 1u);
}

TEST_F(StoreTest, BlocksDroppedBecauseTheDiskIsFullOfPinsAreCounted) {
  auto s = Open(2, 2);
  PutRange(*s, 0, 2);
  auto pinned = Keys(0, 2);
  ASSERT_TRUE(s->Flush().ok());
  for (const BlockKey& k : pinned) {  // both down to disk (write-behind moved one already)
    if (s->Lookup({&k, 1}, false).tiers[0] != Tier::kDisk) ASSERT_TRUE(s->Evict({&k, 1}).ok());
  }
  Status pin = s->Pin(pinned);
  ASSERT_TRUE(pin.ok()) << pin.ToString() << " " << s->Stats().last_error;  // the disk holds only pinned blocks now
  PutRange(*s, 10, 6);               // DRAM overflows: nothing can be written behind
  (void)s->Flush();
  StoreStats st = s->Stats();
  EXPECT_GT(st.dropped, 0u);
  EXPECT_NE(st.last_error.find("disk tier full"), std::string::npos);
  EXPECT_TRUE(GetMatches(*s, 0)) << s->Stats().last_error;  // the pinned ones are intact
  EXPECT_TRUE(GetMatches(*s, 15));
}

}  // namespace
}  // namespace tpusync

// ---- the change feed --------------------------------------------------------------------

namespace tpusync {
namespace {

bool Holds(const std::vector<BlockKey>& keys, const BlockKey& k) {
  return std::find(keys.begin(), keys.end(), k) != keys.end();
}

TEST(ChangeFeedTest, ReadsInOrderAndReportsWhatItLost) {
  ChangeFeed feed(4);
  ChangeBatch first = feed.Since({}, std::chrono::milliseconds(0), 16);
  EXPECT_TRUE(first.lost);  // a first read has no cursor of this feed
  feed.Record(Key(1));
  feed.Record(Key(2));
  ChangeBatch b = feed.Since(first.next, std::chrono::milliseconds(0), 1);
  ASSERT_FALSE(b.lost);
  EXPECT_EQ(b.keys, std::vector<BlockKey>{Key(1)});
  b = feed.Since(b.next, std::chrono::milliseconds(0), 16);
  EXPECT_EQ(b.keys, std::vector<BlockKey>{Key(2)});
  for (uint64_t i = 3; i < 9; ++i) feed.Record(Key(i));  // 6 changes into a ring of 4
  ChangeBatch overrun = feed.Since(b.next, std::chrono::milliseconds(0), 16);
  EXPECT_TRUE(overrun.lost);
  EXPECT_TRUE(feed.Since(overrun.next, std::chrono::milliseconds(0), 16).keys.empty());
  EXPECT_TRUE(feed.Since({feed.epoch() + 1, 0}, std::chrono::milliseconds(0), 16).lost);  // another feed's cursor
}

TEST(ChangeFeedTest, AWaitEndsWithTheFirstChange) {
  ChangeFeed feed;
  ChangeCursor at = feed.Since({}, std::chrono::milliseconds(0), 16).next;
  std::thread writer([&] { feed.Record(Key(7)); });
  // Far longer than the test may take: it returns because the change came, not because it timed out.
  ChangeBatch b;
  while (b.keys.empty()) b = feed.Since(at, std::chrono::milliseconds(60000), 16);
  writer.join();
  EXPECT_EQ(b.keys, std::vector<BlockKey>{Key(7)});
}

TEST_F(StoreTest, EveryTierChangeIsInTheFeed) {
  auto s = Open(4, 8);
  ASSERT_NE(s, nullptr);
  ChangeCursor at = s->Changes({}, std::chrono::milliseconds(0), 1024).next;
  PutRange(*s, 0, 2);
  ChangeBatch put = s->Changes(at, std::chrono::milliseconds(0), 1024);
  ASSERT_FALSE(put.lost);
  EXPECT_TRUE(Holds(put.keys, Key(0)) && Holds(put.keys, Key(1)));
  const std::vector<BlockKey> one = {Key(0)};
  ASSERT_TRUE(s->Evict(one).ok());  // DRAM -> disk
  ChangeBatch demoted = s->Changes(put.next, std::chrono::milliseconds(0), 1024);
  EXPECT_TRUE(Holds(demoted.keys, Key(0)));
  EXPECT_FALSE(Holds(demoted.keys, Key(1)));
  ASSERT_TRUE(s->Evict(one).ok());  // disk -> gone
  ChangeBatch gone = s->Changes(demoted.next, std::chrono::milliseconds(0), 1024);
  EXPECT_TRUE(Holds(gone.keys, Key(0)));
  EXPECT_EQ(s->Lookup(one, false).tiers[0], Tier::kNone);
  PutRange(*s, 2, 6);  // DRAM holds 4: the oldest are written behind on their own
  ASSERT_TRUE(s->Flush().ok());
  ChangeBatch behind = s->Changes(gone.next, std::chrono::milliseconds(0), 1024);
  EXPECT_TRUE(Holds(behind.keys, Key(1)));  // it left DRAM with no call naming it
}

}  // namespace
}  // namespace tpusync
