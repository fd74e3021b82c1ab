#include "sidecar/http.h"

#include <sys/socket.h>

#include <cerrno>

namespace tpusync {
namespace {

const char* Reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 503: return "Service Unavailable";
    default: return "Error";
  }
}

}  // namespace

void ServeHttp(net::Socket& socket, const std::function<HttpResponse(const std::string& path)>& route) {
  net::Deadline d = net::Deadline::After(std::chrono::seconds(5));
  std::string req;
  char buf[1024];
  while (req.find("\r\n\r\n") == std::string::npos) {
    if (req.size() > 8192) return;
    ssize_t n = ::recv(socket.fd(), buf, sizeof(buf), 0);
    if (n > 0) {
      req.append(buf, static_cast<size_t>(n));
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      if (!socket.WaitReadable(-1, d).ok()) return;
    } else {
      return;
    }
  }
  HttpResponse resp;
  size_t sp1 = req.find(' '), sp2 = req.find(' ', sp1 + 1);
  if (sp1 == std::string::npos || sp2 == std::string::npos) return;
  std::string method = req.substr(0, sp1), path = req.substr(sp1 + 1, sp2 - sp1 - 1);
  if (size_t q = path.find('?'); q != std::string::npos) path.resize(q);
  if (method != "GET" && method != "HEAD") {
    resp = {405, "text/plain; charset=utf-8", "only GET\n"};
  } else {
    resp = route(path);
  }
  std::string out = "HTTP/1.1 " + std::to_string(resp.status) + " " + Reason(resp.status) +
                    "\r\nContent-Type: " + resp.content_type + "\r\nContent-Length: " +
                    std::to_string(resp.body.size()) + "\r\nConnection: close\r\n\r\n";
  if (method != "HEAD") out += resp.body;
  (void)socket.WriteFull(out.data(), out.size(), d);
}

}  // namespace tpusync
