#include "net/members.h"

#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <memory>

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
  TPUSYNC_ASSIGN_OR_RETURN(std::vector<std::string> ips, Resolve(hp.first));
  if (ips.empty()) return Status(StatusCode::kUnavailable, "resolve " + hp.first + ": no address");
  const std::string& ip = ips.front();  // the one address dialled
  if (anyone_) return Join(ip, hp.second);
  for (const Entry& e : entries_) {
    if (e.port != 0 && e.port != hp.second) continue;
    Result<std::vector<std::string>> member = Resolve(e.host);
    if (member.ok() && std::find(member->begin(), member->end(), ip) != member->end()) return Join(ip, hp.second);
  }
  return FailedPrecondition("peer " + peer + " is not a member of this pool (" + described_ +
                            "); a sidecar dials only its pool's members");
}

}  // namespace tpusync::net
