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

// Every --peers entry is a host (a name, an IPv4 address, an IPv6 address in brackets) with an
// optional port 1..65535; whitespace around the value and each entry is trimmed, so
// "a:1, b:2" keeps b (it used to keep " b:2", a member no peer ever matched).
TEST(SidecarFlags, PeersKeepsEveryEntryTrimmed) {
  auto f = ParseSidecarFlags({"--peers= a.example:9400, 10.0.0.2 ,[fd00::1]:9400,[::1],pool-peers.ns.svc,"
                              "host-1.example.:1,localhost:65535\n",
                              "--peers-dns= pool-peers.ns.svc.cluster.local "});
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->peers, (std::vector<std::string>{"a.example:9400", "10.0.0.2", "[fd00::1]:9400", "[::1]",
                                                "pool-peers.ns.svc", "host-1.example.:1", "localhost:65535"}));
  EXPECT_EQ(f->peers_dns, "pool-peers.ns.svc.cluster.local");
  for (const char* none : {"--peers=", "--peers=  "}) {  // an empty value: no members listed
    auto g = ParseSidecarFlags({none});
    ASSERT_TRUE(g.ok()) << none << ": " << g.status().ToString();
    EXPECT_TRUE(g->peers.empty()) << none;
  }
}

TEST(SidecarFlags, PeersRefusesMalformedEntriesNamingThem) {
  const std::string long_label(64, 'a');
  std::string long_name;
  for (int i = 0; i < 5; ++i) long_name += std::string(60, 'b') + ".";
  long_name += "c";  // 306 characters
  const std::pair<std::string, std::string> cases[] = {
      {"--peers=a:1,,b:2", "--peers=a:1,,b:2: entry 2 is empty"},
      {"--peers=a:1,", "entry 2 is empty"},
      {"--peers=,a:1", "entry 1 is empty"},
      {"--peers=a:1,b c:2", "--peers entry 'b c:2': ' ' in a name"},
      {"--peers=host_1:9400", "--peers entry 'host_1:9400': '_' in a name"},
      {"--peers=-bad.example", "--peers entry '-bad.example': a label that starts or ends with '-'"},
      {"--peers=a..b", "--peers entry 'a..b': an empty label"},
      {"--peers=" + long_label + ".example", "a label longer than 63 characters"},
      {"--peers=" + long_name, "a name longer than 253 characters"},
      {"--peers=256.1.1.1:9400", "--peers entry '256.1.1.1:9400': neither an IPv4 address"},
      {"--peers=1.2.3", "--peers entry '1.2.3': neither an IPv4 address"},
      {"--peers=010.0.0.1", "--peers entry '010.0.0.1': neither an IPv4 address"},
      {"--peers=a:0", "--peers entry 'a:0': a port must be a number 1..65535"},
      {"--peers=a:65536", "--peers entry 'a:65536': a port"},
      {"--peers=a:+80", "--peers entry 'a:+80': a port"},
      {"--peers=a:80x", "--peers entry 'a:80x': a port"},
      {"--peers=a:", "--peers entry 'a:': a port"},
      {"--peers=:9400", "--peers entry ':9400': an empty host"},
      {"--peers=fd00::1", "--peers entry 'fd00::1': an IPv6 address must be in brackets"},
      {"--peers=[fd00::1", "--peers entry '[fd00::1': an IPv6 address without its closing ']'"},
      {"--peers=[fd00::zz]:1", "--peers entry '[fd00::zz]:1': not an IPv6 address in brackets"},
      {"--peers=[10.0.0.1]:1", "not an IPv6 address in brackets"},
      {"--peers=[fd00::1]9400", "--peers entry '[fd00::1]9400': something other than :port after ']'"},
      {"--peers=[fd00::1]:99999", "--peers entry '[fd00::1]:99999': a port"},
      {"--peers-dns=a,b", "--peers-dns=a,b: one name only"},
      {"--peers-dns=pool-peers:9400", "--peers-dns=pool-peers:9400: a name without a port, not an address"},
      {"--peers-dns=10.0.0.1", "--peers-dns=10.0.0.1: a name without a port"},
      {"--peers-dns=pool_peers.ns", "--peers-dns=pool_peers.ns: '_' in a name"},
  };
  for (const auto& [arg, want] : cases) {
    auto f = ParseSidecarFlags({arg});
    ASSERT_FALSE(f.ok()) << arg;
    EXPECT_NE(f.status().message().find(want), std::string::npos) << arg << ": " << f.status().message();
  }
}

}  // namespace
}  // namespace tpusync
