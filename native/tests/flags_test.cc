#include "sidecar/flags.h"

#include <gtest/gtest.h>

#include <cstdlib>

namespace tpusync {
namespace {

TEST(SidecarFlags, ParsesValuesSuffixesAndEnvironment) {
  ::setenv("TPUSYNC_STREAMS", "3", 1);  // NOLINT(concurrency-mt-unsafe): a single-threaded test
  auto f = ParseSidecarFlags({"--dram-bytes=2Gi", "--block-bytes", "256Ki", "--data-port=0", "--mlock",
                              "--disk-dir=/d", "--disk-bytes=10Gi"});
  ::unsetenv("TPUSYNC_STREAMS");  // NOLINT(concurrency-mt-unsafe): a single-threaded test
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->dram_bytes, 2ull << 30);
  EXPECT_EQ(f->block_bytes, 256u << 10);
  EXPECT_EQ(f->data_port, 0);
  EXPECT_TRUE(f->mlock);
  EXPECT_EQ(f->streams, 3);
  EXPECT_EQ(f->disk_bytes, 10ull << 30);
}

TEST(SidecarFlags, BadValuesNameTheFlag) {
  const std::pair<std::vector<std::string>, const char*> cases[] = {
      {{"--dram-bytes=lots"}, "--dram-bytes=lots"},
      {{"--block-bytes=1000"}, "multiple of 4096"},
      {{"--data-port=70000"}, "--data-port=70000"},
      {{"--streams=0"}, "--streams=0"},
      {{"--no-such-flag=1"}, "unknown flag --no-such-flag"},
      {{"--disk-dir=/d"}, "--disk-bytes"},
      {{"stray"}, "unexpected argument"},
      {{"--pool-path"}, "needs a value"},
      {{"--dram-bytes=-1Gi"}, "--dram-bytes=-1Gi: a size cannot be negative"},
      {{"--dram-bytes=20000000Ti"}, "--dram-bytes=20000000Ti: too large"},
      {{"--dram-bytes=+5Gi"}, "expected bytes"},
      {{"--disk-bytes=10Gi"}, "--disk-bytes without --disk-dir"},
      {{"--shared-layout=m"}, "--shared-layout without --shared-dir"},
      {{"--create-disk-dir"}, "--create-disk-dir without --disk-dir"},
      {{"--shared-policy=demote"}, "--shared-policy without --shared-dir"},
  };
  for (const auto& [args, want] : cases) {
    auto f = ParseSidecarFlags(args);
    ASSERT_FALSE(f.ok()) << want;
    EXPECT_NE(f.status().message().find(want), std::string::npos) << f.status().message();
  }
}

}  // namespace
}  // namespace tpusync
