#include "sidecar/flags.h"

#include <arpa/inet.h>

#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <string_view>

namespace tpusync {
namespace {

// Accepts plain integers with an optional binary suffix: 64Ki, 512Mi, 2Gi, 1Ti.
Result<uint64_t> ParseBytes(const std::string& name, const std::string& v) {
  const std::string what = "--" + name + "=" + v + ": ";
  if (!v.empty() && v[0] == '-') return InvalidArgument(what + "a size cannot be negative");
  char* end = nullptr;
  errno = 0;
  unsigned long long n = std::strtoull(v.c_str(), &end, 10);
  std::string suffix(end);
  const std::map<std::string, uint64_t> mult = {{"", 1}, {"Ki", 1ull << 10}, {"Mi", 1ull << 20},
                                                {"Gi", 1ull << 30}, {"Ti", 1ull << 40}};
  auto it = mult.find(suffix);
  if (v.empty() || end == v.c_str() || it == mult.end() || !std::isdigit(static_cast<unsigned char>(v[0]))) {
    return InvalidArgument(what + "expected bytes such as 1073741824 or 1Gi");
  }
  if (errno == ERANGE || n > UINT64_MAX / it->second) return InvalidArgument(what + "too large");
  return uint64_t{n} * it->second;
}

Result<long> ParseInt(const std::string& name, const std::string& v, long lo, long hi) {
  char* end = nullptr;
  long n = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || n < lo || n > hi) {
    return InvalidArgument("--" + name + "=" + v + ": expected an integer in " + std::to_string(lo) + ".." +
                           std::to_string(hi));
  }
  return n;
}

Result<bool> ParseBool(const std::string& name, const std::string& v) {
  if (v == "true" || v == "1" || v.empty()) return true;
  if (v == "false" || v == "0") return false;
  return InvalidArgument("--" + name + "=" + v + ": expected true or false");
}

using Setter = std::function<Status(SidecarFlags&, const std::string&, const std::string&)>;

template <typename T>
Setter Int(T SidecarFlags::*field, long lo, long hi) {
  return [=](SidecarFlags& f, const std::string& n, const std::string& v) {
    TPUSYNC_ASSIGN_OR_RETURN(long x, ParseInt(n, v, lo, hi));
    f.*field = static_cast<T>(x);
    return Status::Ok();
  };
}

Setter Bytes(uint64_t SidecarFlags::*field) {
  return [=](SidecarFlags& f, const std::string& n, const std::string& v) {
    TPUSYNC_ASSIGN_OR_RETURN(f.*field, ParseBytes(n, v));
    return Status::Ok();
  };
}

Setter Str(std::string SidecarFlags::*field) {
  return [=](SidecarFlags& f, const std::string&, const std::string& v) {
    f.*field = v;
    return Status::Ok();
  };
}

// The hosts --peers and --peers-dns name. Whitespace around a value or an entry is trimmed
// (a list pasted as "a:1, b:2", a value folded in YAML); any other mistake is refused, naming
// the flag and the entry: an entry that never matches a peer would drop a member silently.
constexpr std::string_view kSpace = " \t\r\n";

std::string_view Trim(std::string_view s) {
  size_t first = s.find_first_not_of(kSpace);
  if (first == std::string_view::npos) return {};
  return s.substr(first, s.find_last_not_of(kSpace) - first + 1);
}

bool IsAddress(int family, std::string_view s) {
  unsigned char buf[16];  // in6_addr or in_addr
  return ::inet_pton(family, std::string(s).c_str(), buf) == 1;  // glibc: dotted quads only for AF_INET
}

// Why `name` is not an RFC 1123 host name, or "" when it is: labels of letters, digits and
// hyphens, 1..63 each, no hyphen first or last, 253 characters in all, one final dot allowed.
// A name whose last label is all digits is refused: resolvers read it as a number (1.2.3 is
// 1.2.0.3), so it is a mistyped IPv4 address.
std::string WhyNotName(std::string_view name) {
  if (!name.empty() && name.back() == '.') name.remove_suffix(1);
  if (name.empty()) return "an empty host";
  if (name.size() > 253) return "a name longer than 253 characters";
  std::string_view last;
  for (size_t start = 0; start <= name.size();) {
    size_t end = std::min(name.find('.', start), name.size());
    std::string_view label = name.substr(start, end - start);
    if (label.empty()) return "an empty label (\"..\" or a leading \".\")";
    if (label.size() > 63) return "a label longer than 63 characters";
    for (char c : label) {
      if (std::isalnum(static_cast<unsigned char>(c)) == 0 && c != '-') {
        return std::string("'") + c + "' in a name (letters, digits, '-' and '.' only)";
      }
    }
    if (label.front() == '-' || label.back() == '-') return "a label that starts or ends with '-'";
    last = label;
    start = end + 1;
  }
  if (std::all_of(last.begin(), last.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
    return "neither an IPv4 address (four numbers 0..255, no leading zeros) nor a name";
  }
  return "";
}

// Why `port` is not a port 1..65535 in decimal, or "".
std::string WhyNotPort(std::string_view port) {
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
    return "a port must be a number 1..65535";
  }
  long n = std::stol(std::string(port));
  return n >= 1 && n <= 65535 ? "" : "a port must be a number 1..65535";
}

// Why a --peers entry is not host, host:port, [ipv6] or [ipv6]:port (host: an IPv4 address or
// a name), or "".
std::string WhyNotPeer(std::string_view entry) {
  if (entry.front() == '[') {
    size_t close = entry.find(']');
    if (close == std::string_view::npos) return "an IPv6 address without its closing ']'";
    if (!IsAddress(AF_INET6, entry.substr(1, close - 1))) return "not an IPv6 address in brackets";
    std::string_view rest = entry.substr(close + 1);
    if (rest.empty()) return "";
    if (rest.front() != ':') return "something other than :port after ']'";
    return WhyNotPort(rest.substr(1));
  }
  size_t colon = entry.find(':');
  if (colon != entry.rfind(':')) return "an IPv6 address must be in brackets: [address] or [address]:port";
  std::string_view host = entry.substr(0, colon);
  if (colon != std::string_view::npos) {
    if (std::string why = WhyNotPort(entry.substr(colon + 1)); !why.empty()) return why;
  }
  if (IsAddress(AF_INET, host)) return "";
  return WhyNotName(host);
}

// The refusal of one entry of a list flag, naming the flag and the entry.
Status BadEntry(const std::string& flag, std::string_view entry, const std::string& why) {
  return InvalidArgument("--" + flag + " entry '" + std::string(entry) + "': " + why);
}

Status EmptyEntry(const std::string& flag, const std::string& value, size_t i) {
  return InvalidArgument("--" + flag + "=" + value + ": entry " + std::to_string(i) +
                         " is empty (two commas, or one at an end)");
}

// --peers: comma-separated entries (an empty value: none).
Setter Peers(std::vector<std::string> SidecarFlags::*field) {
  return [=](SidecarFlags& f, const std::string& n, const std::string& v) {
    (f.*field).clear();
    const std::string_view all = Trim(v);
    for (size_t start = 0, i = 1; !all.empty() && start <= all.size(); ++i) {
      size_t end = std::min(all.find(',', start), all.size());
      std::string_view entry = Trim(all.substr(start, end - start));
      if (entry.empty()) return EmptyEntry(n, v, i);
      if (std::string why = WhyNotPeer(entry); !why.empty()) return BadEntry(n, entry, why);
      (f.*field).emplace_back(entry);
      start = end + 1;
    }
    return Status::Ok();
  };
}

// --peers-dns: one name (an empty value: none). Its addresses are members at --data-port, so
// neither a port nor an address belongs in it (a single address is a --peers entry).
Setter DnsName(std::string SidecarFlags::*field) {
  return [=](SidecarFlags& f, const std::string& n, const std::string& v) {
    const std::string_view name = Trim(v);
    std::string why;
    if (name.find(',') != std::string_view::npos) {
      why = "one name only (members of other pools go in --peers)";
    } else if (name.find(':') != std::string_view::npos || IsAddress(AF_INET, name)) {
      why = "a name without a port, not an address (its addresses are members at --data-port; a single address "
            "is a --peers entry)";
    } else if (!name.empty()) {
      why = WhyNotName(name);
    }
    if (!why.empty()) return InvalidArgument("--" + n + "=" + v + ": " + why);
    f.*field = name;
    return Status::Ok();
  };
}

Setter Bool(bool SidecarFlags::*field) {
  return [=](SidecarFlags& f, const std::string& n, const std::string& v) {
    TPUSYNC_ASSIGN_OR_RETURN(f.*field, ParseBool(n, v));
    return Status::Ok();
  };
}

struct FlagDef {
  const char* name;
  Setter set;
  const char* help;
};

const std::vector<FlagDef>& Defs() {
  static const std::vector<FlagDef> defs = {
      {"bind", Str(&SidecarFlags::bind), "address for the data and HTTP ports (default 127.0.0.1)"},
      {"data-port", Int(&SidecarFlags::data_port, 0, 65535), "TCP port for peers (default 9400; 0 = any)"},
      {"http-port", Int(&SidecarFlags::http_port, 0, 65535), "/healthz /readyz /metrics (default 9401; 0 = any)"},
      {"control-socket", Str(&SidecarFlags::control_socket), "UNIX socket for engines in this pod"},
      {"pool-path", Str(&SidecarFlags::pool_path), "shared-memory pool file (default /dev/shm/tpusync-pool)"},
      {"dram-bytes", Bytes(&SidecarFlags::dram_bytes), "DRAM pool size (default 1Gi)"},
      {"block-bytes", Bytes(&SidecarFlags::block_bytes), "block size, a multiple of 4096 (default 2Mi)"},
      {"disk-dir", Str(&SidecarFlags::disk_dir), "directory of the disk tier (default: none)"},
      {"disk-bytes", Bytes(&SidecarFlags::disk_bytes), "disk tier size"},
      {"create-disk-dir", Bool(&SidecarFlags::create_disk_dir),
       "create --disk-dir when it does not exist (else refused: a mistyped SSD path would land on the boot disk)"},
      {"shared-dir", Str(&SidecarFlags::shared_dir),
       "directory on a filesystem every host of the pool mounts (Managed Lustre, Filestore, NFS, FUSE): the shared "
       "tier (default: none)"},
      {"shared-bytes", Bytes(&SidecarFlags::shared_bytes), "the shared tier's capacity (default 0: the filesystem's)"},
      {"shared-layout", Str(&SidecarFlags::shared_layout),
       "what changes a block's bytes besides the block size (model, dtype, parallel sizes, rank): engines with "
       "another layout never read these blocks"},
      {"shared-policy", Str(&SidecarFlags::shared_policy),
       "write-through (every stored block) or demote (blocks leaving DRAM) (default write-through)"},
      {"shared-high-watermark-percent", Int(&SidecarFlags::shared_high_percent, 1, 100),
       "the evictor starts above this share of the capacity (default 85)"},
      {"shared-low-watermark-percent", Int(&SidecarFlags::shared_low_percent, 0, 99),
       "and deletes the least recently read blocks down to this one (default 70)"},
      {"shared-evict-interval-ms", Int(&SidecarFlags::shared_evict_interval_ms, 10, 3600000),
       "how often the tier is scanned: its evictor runs, and the blocks other hosts published or removed reach the "
       "engines' KV events (default 10000)"},
      {"auth-secret-file", Str(&SidecarFlags::auth_secret_file), "file holding the pool's shared secret"},
      {"streams", Int(&SidecarFlags::streams, 1, 64), "parallel TCP streams per peer (default 4)"},
      {"io-threads", Int(&SidecarFlags::io_threads, 1, 64), "disk write-behind threads (default 2)"},
      {"max-connections", Int(&SidecarFlags::max_connections, 1, 65536), "authenticated data connections at most (default 256)"},
      {"max-unauthenticated", Int(&SidecarFlags::max_unauthenticated, 1, 65536),
       "data connections still in their handshake, at most; the oldest is cut for a new one (default 64)"},
      {"max-unauthenticated-per-source", Int(&SidecarFlags::max_unauthenticated_per_source, 1, 65536),
       "of those, from one address (default 8)"},
      {"max-connections-per-source", Int(&SidecarFlags::max_connections_per_source, 1, 65536),
       "authenticated data connections from one address, at most (default 64)"},
      {"handshake-timeout-ms", Int(&SidecarFlags::handshake_timeout_ms, 1, 600000), "a handshake's deadline (default 2000)"},
      {"op-timeout-ms", Int(&SidecarFlags::op_timeout_ms, 1, 3600000), "deadline of one request (default 120000)"},
      {"progress-timeout-ms", Int(&SidecarFlags::progress_timeout_ms, 1, 600000),
       "each frame of a transfer (a block, a reply) must move whole within this, or the connection is cut "
       "(default 10000)"},
      {"drain-timeout-ms", Int(&SidecarFlags::drain_timeout_ms, 0, 3600000), "SIGTERM drain period (default 30000)"},
      {"hugepages", Bool(&SidecarFlags::hugepages), "ask for transparent huge pages"},
      {"mlock", Bool(&SidecarFlags::mlock), "lock the pool in RAM"},
      {"peers", Peers(&SidecarFlags::peers),
       "the pool's members, comma-separated host:port (or host: any port) entries, a host being a name (RFC 1123), "
       "an IPv4 address or an IPv6 address in brackets ([fd00::1]:9400); whitespace around an entry is ignored, "
       "an entry that is not one of these is refused; with --peers-dns, the only data ports this sidecar pulls "
       "from and pushes to (default: none)"},
      {"peers-dns", DnsName(&SidecarFlags::peers_dns),
       "headless Service of the pool, a name (RFC 1123) without a port: its addresses are members at this "
       "sidecar's --data-port; reported on /readyz"},
      {"encrypt", Bool(&SidecarFlags::encrypt),
       "encrypt every data-port session, both ways (AEGIS-128X2); sessions are authenticated either way"},
      {"help", Bool(&SidecarFlags::help), "print this help"},
  };
  return defs;
}

std::string EnvName(const std::string& flag) {
  std::string e = "TPUSYNC_";
  for (char c : flag) e += c == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return e;
}

}  // namespace

Result<SidecarFlags> ParseSidecarFlags(const std::vector<std::string>& args) {
  SidecarFlags f;
  std::set<std::string> given;  // in the environment or on the command line
  for (const FlagDef& d : Defs()) {  // environment first, flags override
    // Flags are parsed at startup, before any thread exists.
    const char* v = std::getenv(EnvName(d.name).c_str());  // NOLINT(concurrency-mt-unsafe)
    if (v != nullptr) TPUSYNC_RETURN_IF_ERROR(d.set(f, d.name, v));
    if (v != nullptr) given.insert(d.name);
  }
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0) return InvalidArgument("unexpected argument '" + a + "' (see --help)");
    std::string name = a.substr(2), value;
    bool has_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1), name.resize(eq), has_value = true;
    }
    const FlagDef* def = nullptr;
    for (const FlagDef& d : Defs()) {
      if (name == d.name) def = &d;
    }
    if (def == nullptr) return InvalidArgument("unknown flag --" + name + " (see --help)");
    bool is_bool = name == "help" || name == "hugepages" || name == "mlock" || name == "encrypt" ||
                   name == "create-disk-dir";
    if (!has_value && !is_bool) {
      if (i + 1 >= args.size()) return InvalidArgument("--" + name + " needs a value");
      value = args[++i];
    }
    TPUSYNC_RETURN_IF_ERROR(def->set(f, name, value));
    given.insert(name);
  }
  // A tier's settings without the tier would be ignored: refuse them instead.
  for (const char* flag : {"disk-bytes", "create-disk-dir"}) {
    if (given.count(flag) != 0 && f.disk_dir.empty()) {
      return InvalidArgument(std::string("--") + flag + " without --disk-dir: there is no disk tier to size");
    }
  }
  for (const char* flag : {"shared-bytes", "shared-layout", "shared-policy", "shared-high-watermark-percent",
                           "shared-low-watermark-percent", "shared-evict-interval-ms"}) {
    if (given.count(flag) != 0 && f.shared_dir.empty()) {
      return InvalidArgument(std::string("--") + flag + " without --shared-dir: there is no shared tier");
    }
  }
  if (f.block_bytes == 0 || f.block_bytes % 4096 != 0) {
    return InvalidArgument("--block-bytes=" + std::to_string(f.block_bytes) + ": must be a multiple of 4096");
  }
  if (f.dram_bytes < f.block_bytes) return InvalidArgument("--dram-bytes must hold at least one block");
  if (!f.disk_dir.empty() && f.disk_bytes < f.block_bytes) {
    return InvalidArgument("--disk-bytes must hold at least one block when --disk-dir is set");
  }
  if (!f.shared_dir.empty()) {
    if (f.shared_policy != "write-through" && f.shared_policy != "demote") {
      return InvalidArgument("--shared-policy=" + f.shared_policy + ": expected write-through or demote");
    }
    if (f.shared_low_percent >= f.shared_high_percent) {
      return InvalidArgument("--shared-low-watermark-percent must be below --shared-high-watermark-percent");
    }
    if (f.shared_bytes != 0 && f.shared_bytes < f.block_bytes) {
      return InvalidArgument("--shared-bytes must hold at least one block (or be 0: the filesystem's)");
    }
  }
  return f;
}

std::string SidecarUsage() {
  std::string s = "usage: tpusync-sidecar [--flag=value]...\n\nEvery flag can also be set as TPUSYNC_<FLAG> in "
                  "the environment; the shared secret as TPUSYNC_AUTH_SECRET.\n\n";
  for (const FlagDef& d : Defs()) s += "  --" + std::string(d.name) + "\n      " + d.help + "\n";
  return s;
}

}  // namespace tpusync
