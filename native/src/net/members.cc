#include "net/members.h"

#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <memory>
#include <optional>

#include "net/socket.h"

namespace tpusync::net {
namespace {

// The numeric addresses `host` names now (one lookup; a literal resolves to itself).
Result<std::vector<std::string>> Resolve(const std::string& host) {
  struct addrinfo hints {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  struct addrinfo* res = nullptr;
  if (int err = ::getaddrinfo(host.c_str(), nullptr, &hints, &res); err != 0) {
    return Status(StatusCode::kUnavailable, "resolve " + host + ": " + ::gai_strerror(err));
  }
  std::unique_ptr<struct addrinfo, decltype(&::freeaddrinfo)> owned(res, &::freeaddrinfo);
  std::vector<std::string> out;
  for (auto* ai = res; ai != nullptr; ai = ai->ai_next) {
    char buf[NI_MAXHOST] = {};
    if (::getnameinfo(ai->ai_addr, ai->ai_addrlen, buf, sizeof buf, nullptr, 0, NI_NUMERICHOST) == 0 &&
        std::find(out.begin(), out.end(), buf) == out.end()) {
      out.emplace_back(buf);
    }
  }
  return out;
}

// `host` in its canonical numeric form when it is an IPv4 or IPv6 literal; nullopt for a name
// (AI_NUMERICHOST: no lookup is made).
std::optional<std::string> NumericAddress(const std::string& host) {
  struct addrinfo hints {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_flags = AI_NUMERICHOST;
  struct addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return std::nullopt;
  std::unique_ptr<struct addrinfo, decltype(&::freeaddrinfo)> owned(res, &::freeaddrinfo);
  char buf[NI_MAXHOST] = {};
  if (::getnameinfo(res->ai_addr, res->ai_addrlen, buf, sizeof buf, nullptr, 0, NI_NUMERICHOST) != 0) {
    return std::nullopt;
  }
  return std::string(buf);
}

std::string Join(const std::string& ip, uint16_t port) {
  return (ip.find(':') != std::string::npos ? "[" + ip + "]" : ip) + ":" + std::to_string(port);
}

}  // namespace

Result<PoolMembers> PoolMembers::Configured(const std::vector<std::string>& peers, const std::string& dns,
                                            uint16_t dns_port) {
  PoolMembers m(false);
  for (const std::string& p : peers) {
    if (p.empty()) continue;
    Result<std::pair<std::string, uint16_t>> hp = SplitHostPort(p);
    if (hp.ok()) {
      m.entries_.push_back({hp->first, hp->second});
    } else if (p.find(':') == std::string::npos || p.front() == '[') {  // a host alone: any port
      m.entries_.push_back({p.front() == '[' ? p.substr(1, p.size() - 2) : p, 0});
    } else {
      return InvalidArgument("--peers entry '" + p + "' is neither host:port nor host");
    }
  }
  m.described_ = peers.empty() ? "--peers is empty" : "--peers lists " + std::to_string(m.entries_.size());
  if (!dns.empty()) {
    m.entries_.push_back({dns, dns_port});
    m.described_ += ", --peers-dns=" + dns;
  } else {
    m.described_ += ", no --peers-dns";
  }
  return m;
}

Result<std::string> PoolMembers::Admit(const std::string& peer) const {
  TPUSYNC_ASSIGN_OR_RETURN(auto hp, SplitHostPort(peer));
  const auto& [host, port] = hp;
  if (anyone_) {  // the caller chose the peer itself: any name resolves
    TPUSYNC_ASSIGN_OR_RETURN(std::vector<std::string> ips, Resolve(host));
    if (ips.empty()) return Status(StatusCode::kUnavailable, "resolve " + host + ": no address");
    return Join(ips.front(), port);
  }
  auto refuse = [&](const std::string& why) {
    return FailedPrecondition("peer " + peer + " is not a member of this pool (" + described_ + ")" + why +
                              "; a sidecar dials only its pool's members");
  };
  // A peer a request names is checked as written, before anything is resolved: a numeric
  // address, or a name configured here. A name the request chose is never looked up (no DNS
  // query per request, no resolver a client can steer).
  const std::optional<std::string> literal = NumericAddress(host);
  if (!literal) {
    for (const Entry& e : entries_) {
      if (e.host != host || (e.port != 0 && e.port != port)) continue;
      TPUSYNC_ASSIGN_OR_RETURN(std::vector<std::string> ips, Resolve(host));
      if (ips.empty()) return Status(StatusCode::kUnavailable, "resolve " + host + ": no address");
      return Join(ips.front(), port);
    }
    return refuse(": a name is admitted only as configured, anything else as a numeric address");
  }
  for (const Entry& e : entries_) {
    if (e.port != 0 && e.port != port) continue;
    Result<std::vector<std::string>> member = Resolve(e.host);  // configured names only
    if (member.ok() && std::find(member->begin(), member->end(), *literal) != member->end()) {
      return Join(*literal, port);
    }
  }
  return refuse("");
}

}  // namespace tpusync::net
