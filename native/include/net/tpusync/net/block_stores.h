// The three BlockStore backends (tpusync/block_store.h), made here; their classes are private
// to the net layer. Each factory connects or opens now, so a bad path, a wrong secret or a dead
// peer shows at once.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "tpusync/block_store.h"
#include "tpusync/status.h"
#include "tpusync/store.h"

namespace tpusync::net {

// How this process reaches peers' data ports (the local store's transfers; the data-port
// client's own connection).
struct PeerOptions {
  std::string secret;  // the pool's shared secret; empty: no transfers with peers
  int streams = 4;     // parallel TCP streams per peer
  std::chrono::milliseconds connect_timeout{5000};
  std::chrono::milliseconds transfer_timeout{120000};  // a whole pull or push
  std::chrono::milliseconds query_timeout{60000};      // an exists query
  bool encrypt = false;  // ask for encrypted sessions (they are authenticated either way)
};

// A Store in this process (opened or re-attached from `store`), and connections to peers
// made on first use and replaced after a failure.
Result<std::unique_ptr<BlockStore>> OpenLocalBlockStore(const StoreOptions& store, PeerOptions peers);

// The sidecar of this pod over its UNIX control socket; maps the sidecar's pool file.
Result<std::unique_ptr<BlockStore>> ConnectSidecar(const std::string& socket_path, std::chrono::milliseconds timeout);

// A sidecar's data port ("host:port"): put pushes, get pulls, lookup asks which blocks it
// holds. It maps no pool, so pins, slots, eviction and transfers between peers return
// kFailedPrecondition. kInvalidArgument without a secret.
Result<std::unique_ptr<BlockStore>> ConnectDataPort(const std::string& address, PeerOptions options);

}  // namespace tpusync::net
