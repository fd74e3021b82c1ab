// Shared helpers for the native tests: scratch directories, patterned blocks and the block
// size most of them store. A test file takes them all with `using namespace testing;`.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "tpusync/block_key.h"

namespace tpusync::testing {

constexpr uint64_t kBlock = 8192;

// A fresh directory under $TMPDIR (or /tmp), removed with its content on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// A unique /dev/shm path, unlinked on destruction.
class ShmPath {
 public:
  ShmPath();
  ~ShmPath();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Deterministic block content that differs for every (key, byte offset).
std::vector<std::byte> Pattern(const BlockKey& key, size_t size);
BlockKey Key(uint64_t i);

// Waits (up to 10 s) until `holds()`: for a state another thread reaches, such as a writer
// counted as waiting in a store's stats. Returns whether it did.
inline bool Eventually(const std::function<bool()>& holds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!holds()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::yield();
  }
  return true;
}

}  // namespace tpusync::testing
