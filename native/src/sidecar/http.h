// A minimal HTTP/1.1 endpoint for probes and scrapes: GET /healthz, /readyz, /metrics.
#pragma once

#include <functional>
#include <string>

#include "net/socket.h"

namespace tpusync {

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

// Serves one request on `socket` with `route(path)` and closes. Requests larger than 8 KiB
// or slower than 5 s are dropped.
void ServeHttp(net::Socket& socket, const std::function<HttpResponse(const std::string& path)>& route);

}  // namespace tpusync
