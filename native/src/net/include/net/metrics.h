// Sidecar metrics, rendered in the Prometheus text exposition format.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <string>

#include "tpusync/store.h"

namespace tpusync {

class Histogram {
 public:
  static constexpr std::array<double, 14> kBounds = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                     0.1,    0.25,  0.5,    1,     2.5,   5,     10};
  void Observe(double seconds);
  void Render(std::string& out, const std::string& name, const std::string& labels) const;

 private:
  std::array<std::atomic<uint64_t>, kBounds.size() + 1> buckets_{};
  std::atomic<uint64_t> count_{0};
  std::atomic<uint64_t> sum_micros_{0};
};

enum class Direction { kIn = 0, kOut = 1 };
enum class TransferOp { kPull = 0, kPush = 1 };
enum class ServerOp { kExists = 0, kPull, kPush, kControl, kCount };

class Metrics {
 public:
  // A block moved over the network; `tier` is where it was served from or landed.
  void Moved(Direction d, TransferOp op, Tier tier, uint64_t bytes, uint64_t blocks = 1);
  void Latency(ServerOp op, double seconds) { latency_[static_cast<size_t>(op)].Observe(seconds); }
  void Error(ServerOp op) { ++errors_[static_cast<size_t>(op)]; }

  std::atomic<uint64_t> auth_failures{0};
  std::atomic<uint64_t> bad_frames{0};
  std::atomic<uint64_t> deadline_exceeded{0};
  std::atomic<uint64_t> connections_total{0};
  std::atomic<int64_t> connections_active{0};
  std::atomic<uint64_t> connections_refused{0};  // over --max-connections; copied from the server
  std::atomic<uint64_t> connections_cut_pending{0};  // pending ones cut for room; copied from the server

  std::string Render(const StoreStats& store) const;

 private:
  static size_t Index(Direction d, TransferOp op, bool disk) {
    return static_cast<size_t>(d) * 4 + static_cast<size_t>(op) * 2 + (disk ? 1 : 0);
  }
  std::array<std::atomic<uint64_t>, 8> bytes_{};
  std::array<std::atomic<uint64_t>, 8> blocks_{};
  std::array<std::atomic<uint64_t>, static_cast<size_t>(ServerOp::kCount)> errors_{};
  std::array<Histogram, static_cast<size_t>(ServerOp::kCount)> latency_;
};

}  // namespace tpusync
