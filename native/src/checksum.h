// Block checksums: XXH3-64 (tens of GB/s, so verifying every disk read costs little).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tpusync {

uint64_t Checksum(const void* data, size_t len);

}  // namespace tpusync
