// The shared tier's trust model (src/store/include/store/shared_tier.h): whoever can write to the shared
// directory without the pool's secret can plant files and links there, and none of it is ever
// read as a block, announced, followed, or used to delete anything outside the tier.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "shared_tier_testing.h"
#include "test_util.h"
#include "tpusync/store.h"

namespace tpusync {
namespace {

using namespace testing;  // NOLINT(google-build-using-namespace): the tests' own helpers
namespace fs = std::filesystem;

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
  ASSERT_TRUE(f.good()) << path;
}

std::span<const std::byte> Bytes(std::string_view s) { return std::as_bytes(std::span(s)); }

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// A file outside the tier, old enough for any sweep of stale files, that must survive.
struct Outside {
  TempDir dir;
  std::string victim = dir.file("victim");
  Outside() {
    WriteFile(victim, "not the tier's to delete");
    const timespec old[2] = {{1000, 0}, {1000, 0}};
    EXPECT_EQ(::utimensat(AT_FDCWD, victim.c_str(), old, 0), 0);
  }
  void ExpectUntouched() const {
    EXPECT_EQ(ReadFile(victim), "not the tier's to delete");
    size_t n = 0;
    for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.path())) ++n;
    EXPECT_EQ(n, 1u) << "something was written outside the tier";
  }
};

TEST(SharedTierTrust, OpeningNeedsTheSecretAndAMountThatExists) {
  TempDir d;
  for (const std::string secret : {"", "fifteen bytes!!"}) {
    auto t = SharedTier::Open({.dir = d.path(), .secret = secret, .layout = "l", .block_bytes = kBlock,
                               .run_evictor = false});
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find("secret"), std::string::npos) << t.status().ToString();
  }
  const std::string missing = d.file("not-mounted");
  auto t = SharedTier::Open({.dir = missing, .secret = kSecret, .layout = "l", .block_bytes = kBlock,
                             .run_evictor = false});
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
  EXPECT_NE(t.status().message().find("does not exist"), std::string::npos) << t.status().ToString();
  EXPECT_FALSE(fs::exists(missing));  // never created: it would be a private "shared" tier
}

TEST(SharedTierTrust, AFileForgedFromWhatTheDirectoryShowsIsAMissAndIsReplaced) {
  TempDir d;
  auto a = Open(d), b = Open(d);
  ASSERT_TRUE(WriteBlock(*a, 1).ok());
  // The forger sees block 1's file and the layout; it writes key 2's file from block 1's header
  // with the key changed and a payload of its own choosing (it cannot compute the tags).
  std::string file = ReadFile(FileOf(*a, 1));
  ASSERT_EQ(file.size(), kFileBytes);
  const BlockKey k2 = Key(2);
  std::memcpy(file.data() + 32, &k2.hi, 8);
  std::memcpy(file.data() + 40, &k2.lo, 8);
  std::memset(file.data() + 4096, 0x5a, kBlock);
  fs::create_directories(fs::path(FileOf(*a, 2)).parent_path());
  WriteFile(FileOf(*a, 2), file);

  EXPECT_FALSE(b->Exists(Key(2)));
  ASSERT_TRUE(b->EvictOnce().ok());
  EXPECT_EQ(b->Catalog(10), std::vector<BlockKey>{Key(1)});  // never announced
  EXPECT_GE(b->Stats().skipped, 1u);
  EXPECT_EQ(ReadBlock(*b, 2).code(), StatusCode::kDataLoss);
  EXPECT_FALSE(fs::exists(FileOf(*a, 2)));  // removed: it is inside the tier

  // Planted again before the real block is written: the write replaces it, no dedup.
  WriteFile(FileOf(*a, 2), file);
  ASSERT_TRUE(WriteBlock(*b, 2).ok());
  EXPECT_EQ(b->Stats().write_dedup, 0u);
  EXPECT_TRUE(ReadBlock(*a, 2).ok());

  // A real header over another payload verifies as a header (a lookup finds it) but fails
  // its payload tag at the read: a miss, removed.
  std::string swapped = ReadFile(FileOf(*a, 1));
  std::memset(swapped.data() + 4096, 0x5a, kBlock);
  WriteFile(FileOf(*a, 1), swapped);
  EXPECT_EQ(ReadBlock(*b, 1).code(), StatusCode::kDataLoss);
  EXPECT_FALSE(fs::exists(FileOf(*a, 1)));
}

TEST(SharedTierTrust, ARecordForgedOrCopiedFromAnotherKeyReadsAsNone) {
  TempDir d;
  auto a = Open(d);
  ASSERT_TRUE(WriteBlock(*a, 1).ok());
  ASSERT_TRUE(a->Describe(Key(1), Bytes("tokens of 1")).ok());
  const auto record_of = [&](uint64_t i) {
    const std::string hex = Key(i).ToHex();
    return a->root() + "/records/" + hex.substr(0, 2) + "/" + hex;
  };
  fs::create_directories(fs::path(record_of(2)).parent_path());
  fs::copy_file(record_of(1), record_of(2));
  EXPECT_EQ(a->Record(Key(2)), "");
  std::string forged = ReadFile(record_of(1));
  forged.back() ^= 1;
  WriteFile(record_of(1), forged);
  EXPECT_EQ(a->Record(Key(1)), "");
}

TEST(SharedTierTrust, TwoPoolsOnOneDirectoryNeverReadNorEvictEachOthersBlocks) {
  TempDir d;
  auto a = Open(d, "l", 0, "pool a's secret, 16+ bytes");
  auto b = Open(d, "l", 4 * kFileBytes, "pool b's secret, 16+ bytes");
  EXPECT_NE(a->root(), b->root());
  for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(WriteBlock(*a, i).ok());
  for (uint64_t i = 0; i < 4; ++i) {
    EXPECT_FALSE(b->Exists(Key(i)));
    EXPECT_EQ(ReadBlock(*b, i).code(), StatusCode::kNotFound);  // never even opened
  }
  // Pool b fills its capacity and evicts: only its own files go.
  for (uint64_t i = 10; i < 20; ++i) ASSERT_TRUE(WriteBlock(*b, i).ok());
  ASSERT_TRUE(b->EvictOnce().ok());
  EXPECT_GT(b->Stats().evictions, 0u);
  for (uint64_t i = 0; i < 4; ++i) EXPECT_TRUE(ReadBlock(*a, i).ok()) << i;
  EXPECT_EQ(a->Stats().corruptions + b->Stats().corruptions, 0u);
}

TEST(SharedTierTrust, NoLinkBelowTheDirectoryIsFollowed) {
  TempDir d;
  Outside out;
  auto a = Open(d, "l", 3 * kFileBytes);
  auto other = Open(d, "another layout");
  ASSERT_TRUE(WriteBlock(*a, 1).ok());
  // Another layout's tmp/ and this layout's tmp/ replaced by links to the outside: the sweep of
  // stale temporary files must not reach the victim.
  for (const std::string& root : {other->root(), a->root()}) {
    fs::rename(root + "/tmp", root + "/tmp.real");
    fs::create_directory_symlink(out.dir.path(), root + "/tmp");
  }
  // A key directory that is a link: a write there is refused, a read is a miss.
  const BlockKey k5{0x5500000000000000ULL, 5};  // in a <kk> directory of its own ("55")
  const std::string kk5 = a->root() + "/55";
  ASSERT_FALSE(fs::exists(kk5));
  fs::create_directory_symlink(out.dir.path(), kk5);
  AlignedBuffer buf(kBlock);
  std::memset(buf.data(), 7, kBlock);
  EXPECT_EQ(a->Write(k5, buf.data(), kBlock).code(), StatusCode::kFailedPrecondition);
  EXPECT_FALSE(a->Exists(k5));
  EXPECT_EQ(a->Read(k5, buf.data(), kBlock).status().code(), StatusCode::kNotFound);
  // A block name that is a link, to a real block file and to the victim.
  fs::create_directories(fs::path(FileOf(*a, 6)).parent_path());
  fs::create_symlink(FileOf(*a, 1), FileOf(*a, 6));
  fs::create_directories(fs::path(FileOf(*a, 7)).parent_path());
  fs::create_symlink(out.victim, FileOf(*a, 7));
  for (uint64_t i : {6, 7}) {
    EXPECT_FALSE(a->Exists(Key(i)));
    EXPECT_EQ(ReadBlock(*a, i).code(), StatusCode::kNotFound);
    EXPECT_EQ(a->Pin(Key(i)).code(), StatusCode::kNotFound);
  }
  // Records and pins directories that are links.
  fs::create_directory_symlink(out.dir.path(), a->root() + "/records/55");
  EXPECT_FALSE(a->Describe(k5, Bytes("r")).ok());
  EXPECT_EQ(a->Record(k5), "");
  fs::rename(a->root() + "/pins", a->root() + "/pins.real");
  fs::create_directory_symlink(out.dir.path(), a->root() + "/pins");
  EXPECT_FALSE(a->Pin(Key(1)).ok());
  // Over the watermark, every pass (each checks one records directory for orphans). While tmp/
  // is a link, nothing can be taken aside, so nothing is evicted; once it is a directory again,
  // the pass evicts, past every link.
  ASSERT_TRUE(WriteBlock(*a, 2).ok());
  ASSERT_TRUE(WriteBlock(*a, 3).ok());
  for (int i = 0; i < 256; ++i) ASSERT_TRUE(a->EvictOnce().ok());
  ASSERT_TRUE(other->EvictOnce().ok());
  EXPECT_EQ(a->Stats().evictions, 0u);
  out.ExpectUntouched();
  fs::remove(a->root() + "/tmp");
  fs::rename(a->root() + "/tmp.real", a->root() + "/tmp");
  ASSERT_TRUE(a->EvictOnce().ok());
  EXPECT_GT(a->Stats().evictions, 0u);
  EXPECT_EQ(a->Catalog(10).size(), a->Stats().blocks);
  for (const BlockKey& k : a->Catalog(10)) EXPECT_TRUE(k == Key(1) || k == Key(2) || k == Key(3));
  EXPECT_GT(a->Stats().skipped, 0u);
  out.ExpectUntouched();
}

TEST(SharedTierTrust, EntriesThatCannotBeBlocksAreNeverCataloguedNorCounted) {
  TempDir d, pool_dir;
  auto t = Open(d);
  auto dir_of = [&](uint64_t i) {
    fs::create_directories(fs::path(FileOf(*t, i)).parent_path());
    return FileOf(*t, i);
  };
  WriteFile(dir_of(10), "");                    // empty
  WriteFile(dir_of(11), std::string(100, 'x'));  // short
  fs::create_directory(dir_of(12));             // a directory
  ASSERT_EQ(::mkfifo(dir_of(13).c_str(), 0600), 0);  // a FIFO: must not hang an open
  WriteFile(fs::path(FileOf(*t, 10)).parent_path() / "not-a-key", std::string(kFileBytes, 'x'));
  ASSERT_TRUE(t->EvictOnce().ok());
  EXPECT_TRUE(t->Catalog(100).empty());
  EXPECT_EQ(t->Stats().blocks, 0u);
  EXPECT_GE(t->Stats().skipped, 4u);
  for (uint64_t i = 10; i < 14; ++i) {
    EXPECT_FALSE(t->Exists(Key(i))) << i;
    EXPECT_NE(ReadBlock(*t, i).code(), StatusCode::kOk) << i;
  }
  // Logged once each: a second pass counts them again but is quiet (the count still grows).
  const uint64_t skipped = t->Stats().skipped;
  ASSERT_TRUE(t->EvictOnce().ok());
  EXPECT_GT(t->Stats().skipped, skipped);

  // Through a store on the same directory (another host): neither a lookup nor Where counts them.
  ShmPath pool;
  StoreOptions o;
  o.pool = {.path = pool.path(), .block_bytes = kBlock, .num_slots = 4};
  o.shared_enabled = true;
  o.shared = {.dir = d.path(), .secret = kSecret, .layout = "model=m;tp=1;rank=0", .run_evictor = false};
  auto s = Store::Open(o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  const BlockKey keys[2] = {Key(11), Key(13)};
  EXPECT_EQ((*s)->Lookup(keys, false).prefix_len, 0u);
  for (Tier tier : (*s)->Where(keys)) EXPECT_EQ(tier, Tier::kNone);
}

}  // namespace
}  // namespace tpusync
