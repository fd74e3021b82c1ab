// Sidecar settings: every flag `--name=value` also reads from env TPUSYNC_NAME.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tpusync/status.h"

namespace tpusync {

struct SidecarFlags {
  std::string bind = "127.0.0.1";
  uint16_t data_port = 9400;
  uint16_t http_port = 9401;
  std::string control_socket;  // empty: no control channel
  std::string pool_path = "/dev/shm/tpusync-pool";
  uint64_t dram_bytes = 1ull << 30;
  uint64_t block_bytes = 2ull << 20;
  std::string disk_dir;  // empty: no disk tier
  bool create_disk_dir = false;  // else a --disk-dir that does not exist is refused
  uint64_t disk_bytes = 0;
  std::string shared_dir;     // empty: no shared tier
  uint64_t shared_bytes = 0;  // 0: the whole filesystem
  std::string shared_layout;  // what, besides the block size, changes a block's bytes
  std::string shared_policy = "write-through";  // or "demote"
  int shared_high_percent = 85;
  int shared_low_percent = 70;
  int shared_evict_interval_ms = 10000;
  std::string auth_secret_file;  // or env TPUSYNC_AUTH_SECRET
  int streams = 4;
  int io_threads = 2;
  int max_connections = 256;         // authenticated data connections
  int max_unauthenticated = 64;      // data connections still in their handshake
  int max_unauthenticated_per_source = 8;
  int max_connections_per_source = 64;  // authenticated data connections from one address
  int handshake_timeout_ms = 2000;
  int op_timeout_ms = 120000;
  int progress_timeout_ms = 10000;  // a frame of a transfer moves whole within this
  int drain_timeout_ms = 30000;
  bool hugepages = false;
  bool mlock = false;
  bool encrypt = false;            // encrypt every data-port session
  // The pool's members, the only data ports this sidecar dials: host:port or host entries, and
  // the pool's headless Service (its addresses, at this sidecar's --data-port).
  std::vector<std::string> peers;
  std::string peers_dns;
  bool help = false;
};

// Parses argv (and env); kInvalidArgument names the bad flag.
Result<SidecarFlags> ParseSidecarFlags(const std::vector<std::string>& args);
std::string SidecarUsage();

}  // namespace tpusync
