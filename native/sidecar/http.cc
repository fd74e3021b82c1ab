#include "sidecar/http.h"

#include <sys/socket.h>

#include <cerrno>

namespace tpusync {
namespace {

const char* Reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 503: return "Service Unavailable";
    default: return "Error";
  }
}

std::string Render(const HttpResponse& resp, bool with_body) {
  std::string out = "HTTP/1.1 " + std::to_string(resp.status) + " " + Reason(resp.status) +
                    "\r\nContent-Type: " + resp.content_type + "\r\nContent-Length: " +
                    std::to_string(resp.body.size()) + "\r\nConnection: close\r\n\r\n";
  if (with_body) out += resp.body;
  return out;
}

}  // namespace

std::optional<HttpRequest> ParseHttpHead(std::string_view head) {
  size_t eol = head.find("\r\n");
  if (eol == std::string_view::npos || head.size() > kMaxHttpHead) return std::nullopt;
  std::string_view line = head.substr(0, eol);
  size_t sp1 = line.find(' ');
  if (sp1 == std::string_view::npos || sp1 == 0) return std::nullopt;
  size_t sp2 = line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos || sp2 == sp1 + 1) return std::nullopt;
  if (line.substr(sp2 + 1).rfind("HTTP/1.", 0) != 0) return std::nullopt;
  std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  if (target.front() != '/') return std::nullopt;
  if (size_t q = target.find('?'); q != std::string_view::npos) target = target.substr(0, q);
  return HttpRequest{std::string(line.substr(0, sp1)), std::string(target)};
}

void ServeHttp(net::Connection& conn, const std::function<HttpResponse(const std::string& path)>& route) {
  net::Socket& socket = conn.socket();
  net::Deadline d = net::Deadline::After(kHttpHeadTimeout);
  std::string head;
  char buf[1024];
  while (head.find("\r\n\r\n") == std::string::npos) {
    if (head.size() > kMaxHttpHead) return;
    ssize_t n = ::recv(socket.fd(), buf, sizeof(buf), 0);
    if (n > 0) {
      head.append(buf, static_cast<size_t>(n));
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      if (!socket.WaitReadable(-1, d).ok()) return;
    } else {
      return;
    }
  }
  d = net::Deadline::After(kHttpHeadTimeout);
  std::optional<HttpRequest> req = ParseHttpHead(head.substr(0, head.find("\r\n\r\n") + 4));
  HttpResponse resp;
  if (!req) {
    resp = {400, "text/plain; charset=utf-8", "bad request\n"};
  } else if (!conn.Admit().ok()) {
    resp = {503, "text/plain; charset=utf-8", "busy\n"};
  } else if (req->method != "GET" && req->method != "HEAD") {
    resp = {405, "text/plain; charset=utf-8", "only GET\n"};
  } else {
    resp = route(req->path);
  }
  std::string out = Render(resp, !req || req->method != "HEAD");
  (void)socket.WriteFull(out.data(), out.size(), d);
}

void RefuseHttp(net::Socket& socket, const std::string& why) {
  std::string out = Render({503, "text/plain; charset=utf-8", why + "\n"}, true);
  if (::send(socket.fd(), out.data(), out.size(), MSG_DONTWAIT | MSG_NOSIGNAL) < 0) return;
  ::shutdown(socket.fd(), SHUT_WR);
}

}  // namespace tpusync
