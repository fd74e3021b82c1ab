// Bulk copies between pool slots and caller buffers.
#pragma once

#include <cstddef>

namespace tpusync {

// Copies n bytes. Large copies use 32-byte streaming stores where the CPU has AVX2: they skip
// the read-for-ownership of the destination and do not depend on src and dst sharing an
// alignment (glibc's `rep movsb` path slows to half speed on some CPUs when they differ,
// which is the usual case between a page-aligned slot and a malloc'ed numpy array).
void CopyBytes(void* dst, const void* src, size_t n);

}  // namespace tpusync
