// PoolMembers: the data ports a sidecar may dial. A sidecar pulls from and pushes to members of
// its pool only, so neither an engine's request nor a completion request's kv_transfer_params
// can point it at another host: no port scanning through it, no relay into another pool.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tpusync/status.h"

namespace tpusync::net {

class PoolMembers {
 public:
  // No check: the caller names its peers itself (an in-process store, a client of a data port).
  static PoolMembers Anyone() { return PoolMembers(true); }
  // `peers`: "host:port" entries (that port) or "host" entries (any port), hosts as addresses or
  // names; `dns`: a name whose addresses are all members, at `dns_port` (0: any port) — the
  // pool's headless Service. Nothing configured: every peer is refused, saying how to configure.
  static Result<PoolMembers> Configured(const std::vector<std::string>& peers, const std::string& dns,
                                         uint16_t dns_port);

  // The numeric "address:port" to dial for `peer` when it is a member, resolved once and
  // checked, so the address checked is the address dialled (a name that resolves elsewhere
  // later changes nothing). `peer` must be a numeric address of a member, or a name exactly as
  // configured: a name it brings is never resolved (requests choose peers, so a lookup per
  // request would be theirs to steer). kFailedPrecondition otherwise, naming the peer.
  Result<std::string> Admit(const std::string& peer) const;

 private:
  struct Entry {
    std::string host;
    uint16_t port = 0;  // 0: any
  };
  explicit PoolMembers(bool anyone) : anyone_(anyone) {}
  bool anyone_;
  std::vector<Entry> entries_;  // the DNS name is the last entry when configured
  std::string described_;       // for refusals
};

}  // namespace tpusync::net
