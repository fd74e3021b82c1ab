// The argument check of BlockStore::Put shared by the backends that send blocks over a channel
// (the sidecar client, the data-port client): refused here, before a round trip, as the
// Store itself would refuse them.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "tpusync/block_key.h"
#include "tpusync/status.h"
#include "tpusync/types.h"

namespace tpusync::net {

// kInvalidArgument unless there is one buffer per key, each of 1..block_bytes bytes.
inline Status CheckPutBuffers(std::span<const BlockKey> keys, std::span<const ConstBuffer> buffers,
                              uint64_t block_bytes) {
  if (keys.size() != buffers.size()) return InvalidArgument("put: keys and buffers differ in number");
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (buffers[i].size == 0 || buffers[i].size > block_bytes) {
      return InvalidArgument("put: buffer " + std::to_string(i) + " holds " + std::to_string(buffers[i].size) +
                             " bytes; blocks hold 1.." + std::to_string(block_bytes));
    }
  }
  return Status::Ok();
}

}  // namespace tpusync::net
