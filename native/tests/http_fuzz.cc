// libFuzzer target: arbitrary bytes as an HTTP request head, as anyone on the pod network
// could send them to /healthz. Must never crash, and a parsed request must be well formed.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "sidecar/http.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view head(reinterpret_cast<const char*>(data), size);
  auto req = tpusync::ParseHttpHead(head);
  if (req && (req->method.empty() || req->path.empty() || req->path.front() != '/' ||
              req->path.find('?') != std::string::npos)) {
    std::abort();
  }
  return 0;
}
