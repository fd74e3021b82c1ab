// A minimal HTTP/1.1 endpoint for probes and scrapes: GET /healthz, /readyz, /metrics.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "net/server.h"

namespace tpusync {

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

struct HttpRequest {
  std::string method, path;  // path without its query
};

constexpr size_t kMaxHttpHead = 8192;
constexpr std::chrono::milliseconds kHttpHeadTimeout{2000};

// Parses a complete request head ("METHOD SP target SP version CRLF ... CRLF CRLF"); nullopt
// if it is not one. Pure, so it can be fuzzed.
std::optional<HttpRequest> ParseHttpHead(std::string_view head);

// Serves one request with `route(path)` and closes. A head larger than kMaxHttpHead or slower
// than kHttpHeadTimeout is dropped; the connection is admitted only once its head arrived,
// so idle connections stay pending (and are cut first when the pending budget is full).
void ServeHttp(net::Connection& conn, const std::function<HttpResponse(const std::string& path)>& route);

// A refusal a probe understands: 503 with the reason.
void RefuseHttp(net::Socket& socket, const std::string& why);

}  // namespace tpusync
