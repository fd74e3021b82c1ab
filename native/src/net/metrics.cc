#include "net/metrics.h"

#include <cstdio>

namespace tpusync {
namespace {

constexpr const char* kOpNames[] = {"exists", "pull", "push", "control"};

void Line(std::string& out, const std::string& name, const std::string& labels, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  out += name;
  if (!labels.empty()) out += "{" + labels + "}";
  out += " ";
  out += buf;
  out += "\n";
}

void Meta(std::string& out, const std::string& name, const char* type, const char* help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

}  // namespace

void Histogram::Observe(double seconds) {
  size_t i = 0;
  while (i < kBounds.size() && seconds > kBounds[i]) ++i;
  ++buckets_[i];
  ++count_;
  sum_micros_ += static_cast<uint64_t>(seconds * 1e6);
}

void Histogram::Render(std::string& out, const std::string& name, const std::string& labels) const {
  uint64_t cumulative = 0;
  std::string sep = labels.empty() ? "" : labels + ",";
  for (size_t i = 0; i < kBounds.size(); ++i) {
    cumulative += buckets_[i].load();
    char le[32];
    std::snprintf(le, sizeof(le), "%g", kBounds[i]);
    Line(out, name + "_bucket", sep + "le=\"" + le + "\"", static_cast<double>(cumulative));
  }
  cumulative += buckets_[kBounds.size()].load();
  Line(out, name + "_bucket", sep + "le=\"+Inf\"", static_cast<double>(cumulative));
  Line(out, name + "_sum", labels, sum_micros_.load() / 1e6);
  Line(out, name + "_count", labels, static_cast<double>(count_.load()));
}

void Metrics::Moved(Direction d, TransferOp op, Tier tier, uint64_t bytes, uint64_t blocks) {
  size_t i = Index(d, op, tier == Tier::kDisk);
  bytes_[i] += bytes;
  blocks_[i] += blocks;
}

std::string Metrics::Render(const StoreStats& s) const {
  std::string out;
  Meta(out, "tpusync_transfer_bytes_total", "counter", "Block bytes moved over the network.");
  Meta(out, "tpusync_transfer_blocks_total", "counter", "Blocks moved over the network.");
  for (size_t d = 0; d < 2; ++d) {
    for (size_t op = 0; op < 2; ++op) {
      for (size_t disk = 0; disk < 2; ++disk) {
        size_t i = d * 4 + op * 2 + disk;
        std::string labels = std::string("direction=\"") + (d ? "out" : "in") + "\",op=\"" + (op ? "push" : "pull") +
                             "\",tier=\"" + (disk ? "disk" : "dram") + "\"";
        Line(out, "tpusync_transfer_bytes_total", labels, static_cast<double>(bytes_[i].load()));
        Line(out, "tpusync_transfer_blocks_total", labels, static_cast<double>(blocks_[i].load()));
      }
    }
  }
  Meta(out, "tpusync_request_duration_seconds", "histogram", "Time to serve one request.");
  for (size_t op = 0; op < latency_.size(); ++op) {
    latency_[op].Render(out, "tpusync_request_duration_seconds", std::string("op=\"") + kOpNames[op] + "\"");
  }
  Meta(out, "tpusync_request_errors_total", "counter", "Requests that ended in an error.");
  for (size_t op = 0; op < errors_.size(); ++op) {
    Line(out, "tpusync_request_errors_total", std::string("op=\"") + kOpNames[op] + "\"",
         static_cast<double>(errors_[op].load()));
  }
  // One unlabelled sample each; `v` a count (converted here) or seconds.
  auto sample = [&](const char* type, const char* name, const char* help, auto v) {
    Meta(out, name, type, help);
    Line(out, name, "", static_cast<double>(v));
  };
  auto counter = [&](const char* name, const char* help, auto v) { sample("counter", name, help, v); };
  auto gauge = [&](const char* name, const char* help, auto v) { sample("gauge", name, help, v); };
  counter("tpusync_auth_failures_total", "Peers that failed the handshake.", auth_failures.load());
  counter("tpusync_bad_frames_total", "Frames rejected by validation.", bad_frames.load());
  counter("tpusync_deadline_exceeded_total", "Operations that passed their deadline.", deadline_exceeded.load());
  counter("tpusync_connections_total", "Connections accepted.", connections_total.load());
  gauge("tpusync_connections_active", "Connections being served.", connections_active.load());
  counter("tpusync_connections_refused_total",
          "Data connections closed unserved: over --max-connections, or over the unauthenticated budgets.",
          connections_refused.load());
  counter("tpusync_connections_cut_pending_total",
          "Unauthenticated data connections cut off to make room for new ones (--max-unauthenticated).",
          connections_cut_pending.load());
  gauge("tpusync_pool_block_bytes", "Block size.", s.block_bytes);
  gauge("tpusync_pool_dram_slots", "DRAM slots.", s.dram_slots);
  gauge("tpusync_pool_dram_used_slots", "DRAM slots holding blocks.", s.dram_used);
  gauge("tpusync_pool_disk_extents", "Disk extents.", s.disk_extents);
  gauge("tpusync_pool_disk_used_extents", "Disk extents holding blocks.", s.disk_used);
  gauge("tpusync_pool_pinned_blocks", "Pinned blocks.", s.pinned);
  counter("tpusync_evictions_total", "Blocks evicted from DRAM.", s.evictions);
  counter("tpusync_demotions_total", "Blocks written behind to disk.", s.demotions);
  counter("tpusync_promotions_total", "Blocks read back from disk into DRAM.", s.promotions);
  counter("tpusync_disk_evictions_total", "Blocks evicted from disk.", s.disk_evictions);
  counter("tpusync_corruptions_total", "Stored blocks that failed their checksum.", s.corruptions);
  counter("tpusync_disk_errors_total", "Disk reads and writes that failed.", s.disk_write_errors + s.disk_read_errors);
  counter("tpusync_blocks_dropped_total", "Blocks that left DRAM without reaching disk (write-behind failed or disk full of pinned blocks).",
          s.dropped);
  counter("tpusync_hits_total", "Blocks found by get (dram + disk + shared).",
          s.hits_dram + s.hits_disk + s.hits_shared);
  if (s.shared_enabled) {
    const SharedTierStats& sh = s.shared;
    gauge("tpusync_shared_capacity_bytes", "The shared tier's capacity.", sh.capacity_bytes);
    gauge("tpusync_shared_used_bytes", "Bytes of blocks on the shared tier, every host's.", sh.used_bytes);
    gauge("tpusync_shared_blocks", "Blocks of this layout on the shared tier at the last scan, every host's.",
          sh.blocks);
    counter("tpusync_shared_hits_total", "Blocks read from the shared tier.", sh.hits);
    counter("tpusync_shared_misses_total", "Shared-tier reads of absent blocks.", sh.misses);
    counter("tpusync_shared_written_total", "Blocks this host wrote to the shared tier.", sh.writes);
    counter("tpusync_shared_read_bytes_total", "Bytes read from the shared tier.", sh.bytes_read);
    counter("tpusync_shared_written_bytes_total", "Bytes written to the shared tier.", sh.bytes_written);
    counter("tpusync_shared_evictions_total", "Shared-tier files this host's evictor deleted.", sh.evictions);
    counter("tpusync_shared_corrupt_files_total",
            "Shared-tier files that failed verification (removed): damaged, or written without the pool's secret.",
            sh.corruptions);
    counter("tpusync_shared_skipped_total",
            "Entries of the shared directory that scans and reads passed over: links (never followed), other "
            "types, sizes or headers that do not verify.",
            sh.skipped);
    counter("tpusync_shared_refused_total", "Shared-tier writes refused: the tier or its filesystem was full.",
            sh.refused_full);
    counter("tpusync_shared_errors_total", "Shared-tier reads and writes that failed.",
            sh.read_errors + sh.write_errors);
    counter("tpusync_shared_read_seconds_total", "Time in shared-tier reads that succeeded.", sh.read_ns / 1e9);
    counter("tpusync_shared_write_seconds_total", "Time in shared-tier writes that succeeded.", sh.write_ns / 1e9);
  }
  counter("tpusync_misses_total", "Blocks not found by get.", s.misses);
  return out;
}

}  // namespace tpusync
