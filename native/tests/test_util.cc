#include "test_util.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>

namespace tpusync::testing {

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");  // NOLINT(concurrency-mt-unsafe): nothing sets it meanwhile
  std::string tmpl = std::string(base ? base : "/tmp") + "/tpusync-test-XXXXXX";
  path_ = ::mkdtemp(tmpl.data());
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

ShmPath::ShmPath() {
  static std::atomic<int> n{0};
  path_ = "/dev/shm/tpusync-test-" + std::to_string(::getpid()) + "-" + std::to_string(n++);
  ::unlink(path_.c_str());
}

ShmPath::~ShmPath() { ::unlink(path_.c_str()); }

std::vector<std::byte> Pattern(const BlockKey& key, size_t size) {
  std::vector<std::byte> v(size);
  uint64_t x = key.lo * 0x9E3779B97F4A7C15ULL + key.hi + 1;
  for (size_t i = 0; i < size; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    v[i] = static_cast<std::byte>(x);
  }
  return v;
}

BlockKey Key(uint64_t i) { return {0xabcdef0000000000ULL | i, i * 7919 + 1}; }

}  // namespace tpusync::testing
