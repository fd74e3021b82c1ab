#include "sidecar/sidecar.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>

#include "base/log.h"

namespace tpusync {

Result<std::unique_ptr<Sidecar>> Sidecar::Start(const SidecarFlags& f) {
  std::unique_ptr<Sidecar> s(new Sidecar());
  s->flags_ = f;
  std::optional<net::Secret> secret;
  if (!f.auth_secret_file.empty()) {
    TPUSYNC_ASSIGN_OR_RETURN(secret, net::Secret::FromFile(f.auth_secret_file));
  } else if (const char* env = std::getenv("TPUSYNC_AUTH_SECRET");  // NOLINT(concurrency-mt-unsafe): at startup
             env != nullptr && std::string(env).size() >= 16) {
    secret.emplace(env);
  } else {
    return FailedPrecondition("no shared secret: set --auth-secret-file or TPUSYNC_AUTH_SECRET (16+ bytes); "
                              "the data port never runs unauthenticated");
  }

  if (!f.disk_dir.empty() && !f.create_disk_dir) {
    struct stat st{};
    if (::stat(f.disk_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return NotFound("--disk-dir=" + f.disk_dir + " is not a directory: mount the disk there, or pass " +
                      "--create-disk-dir to create it");
    }
  }
  StoreOptions o;
  o.pool = {.path = f.pool_path, .block_bytes = f.block_bytes, .num_slots = f.dram_bytes / f.block_bytes,
            .hugepages = f.hugepages, .mlock = f.mlock};
  o.disk_enabled = !f.disk_dir.empty();
  o.disk = {.dir = f.disk_dir, .capacity_bytes = f.disk_bytes};
  o.shared_enabled = !f.shared_dir.empty();
  o.shared = {.dir = f.shared_dir,
              .secret = secret->bytes(),
              .layout = f.shared_layout,
              .capacity_bytes = f.shared_bytes,
              .high_watermark = f.shared_high_percent / 100.0,
              .low_watermark = f.shared_low_percent / 100.0,
              .evict_interval = std::chrono::milliseconds(f.shared_evict_interval_ms)};
  o.shared_policy = f.shared_policy == "demote" ? SharedPolicy::kDemote : SharedPolicy::kWriteThrough;
  o.io_threads = static_cast<uint32_t>(f.io_threads);
  TPUSYNC_ASSIGN_OR_RETURN(s->store_, Store::Open(o));
  StoreStats st = s->store_->Stats();
  Log(LogLevel::kInfo, "sidecar",
      "pool " + f.pool_path + ": " + std::to_string(st.dram_slots) + " slots of " + std::to_string(st.block_bytes) +
          " bytes, re-attached " + std::to_string(st.recovered_dram) + " DRAM and " +
          std::to_string(st.recovered_disk) + " disk blocks");
  Log(LogLevel::kInfo, "sidecar",
      "tiers: DRAM " + std::to_string(f.dram_bytes) + " bytes; disk " +
          (f.disk_dir.empty() ? std::string("off") : f.disk_dir + " " + std::to_string(f.disk_bytes) + " bytes") +
          "; shared " +
          (f.shared_dir.empty() ? std::string("off")
                                : f.shared_dir + " (" + f.shared_policy + ", layout \"" + f.shared_layout + "\")"));

  net::PeerClientOptions client_options{.streams = f.streams,
                                        .connect_timeout = std::chrono::milliseconds(f.handshake_timeout_ms),
                                        .block_bytes = f.block_bytes,
                                        .encrypt = f.encrypt,
                                        .progress_timeout = std::chrono::milliseconds(f.progress_timeout_ms)};
  TPUSYNC_ASSIGN_OR_RETURN(net::PoolMembers members, net::PoolMembers::Configured(f.peers, f.peers_dns, f.data_port));
  s->peers_ = std::make_unique<net::PeerPool>(*secret, client_options, std::move(members));
  s->peer_service_ = std::make_unique<net::PeerService>(
      *s->store_, *secret, s->metrics_,
      net::PeerServiceOptions{.handshake_timeout = std::chrono::milliseconds(f.handshake_timeout_ms),
                              .op_timeout = std::chrono::milliseconds(f.op_timeout_ms),
                              .progress_timeout = std::chrono::milliseconds(f.progress_timeout_ms),
                              .encrypt = f.encrypt});
  s->control_service_ = std::make_unique<net::ControlService>(*s->store_, *s->peers_, s->metrics_,
                                                              std::chrono::milliseconds(f.op_timeout_ms));

  TPUSYNC_ASSIGN_OR_RETURN(net::Listener data_l, net::Listener::ListenTcp(f.bind, f.data_port));
  TPUSYNC_ASSIGN_OR_RETURN(net::Listener http_l, net::Listener::ListenTcp(f.bind, f.http_port));
  Sidecar* self = s.get();
  s->data_ = std::make_unique<net::ConnectionServer>(
      "data", std::move(data_l), [self](net::Connection& conn) { self->peer_service_->Serve(conn); },
      net::ServerLimits{.max_admitted = static_cast<size_t>(f.max_connections),
                        .max_admitted_per_source = static_cast<size_t>(f.max_connections_per_source),
                        .max_pending = static_cast<size_t>(f.max_unauthenticated),
                        .max_pending_per_source = static_cast<size_t>(f.max_unauthenticated_per_source)});
  // Probes must stay answerable: a connection is pending until its request head arrives, a
  // head is read for at most 2 s, and idle connections are cut first to make room.
  s->http_ = std::make_unique<net::ConnectionServer>(
      "http", std::move(http_l),
      [self](net::Connection& conn) { ServeHttp(conn, [self](auto& p) { return self->Route(p); }); },
      net::ServerLimits{.max_admitted = 64, .max_admitted_per_source = 64, .max_pending = 64,
                        .max_pending_per_source = 16},
      RefuseHttp);
  if (!f.control_socket.empty()) {
    TPUSYNC_ASSIGN_OR_RETURN(net::Listener ctl_l, net::Listener::ListenUnix(f.control_socket));
    // Engines in the pod: admitted at once (the socket file's permissions are the check).
    s->control_ = std::make_unique<net::ConnectionServer>(
        "control", std::move(ctl_l), [self](net::Connection& conn) { self->control_service_->Serve(conn); },
        net::ServerLimits{.max_admitted = 1024, .max_pending = 1024});
    s->control_->Start();
  }
  s->data_->Start();
  s->http_->Start();
  s->ready_ = true;
  return s;
}

HttpResponse Sidecar::Route(const std::string& path) {
  if (path == "/healthz") return {200, "text/plain; charset=utf-8", "ok\n"};
  if (path == "/readyz") {
    if (!ready_) return {503, "text/plain; charset=utf-8", "draining\n"};
    std::string body = "ready\n";
    if (!flags_.peers_dns.empty()) body += "peers " + flags_.peers_dns + "\n";
    return {200, "text/plain; charset=utf-8", body};
  }
  if (path == "/metrics") {
    metrics_.connections_refused = data_->refused();
    metrics_.connections_cut_pending = data_->cut_pending();
    return {200, "text/plain; version=0.0.4; charset=utf-8", metrics_.Render(store_->Stats())};
  }
  return {404, "text/plain; charset=utf-8", "not found\n"};
}

void Sidecar::Stop() {
  if (!ready_.exchange(false) && !data_) return;
  auto drain = std::chrono::milliseconds(flags_.drain_timeout_ms);
  Log(LogLevel::kInfo, "sidecar", "draining: " + std::to_string(data_->active()) + " data connections");
  data_->Stop(drain);
  if (control_) {
    control_->Stop(drain);
    ::unlink(flags_.control_socket.c_str());  // a clean stop leaves no socket behind
  }
  Status st = store_->Flush();
  if (!st.ok()) Log(LogLevel::kWarning, "sidecar", "write-behind at exit: " + st.ToString());
  http_->Stop(std::chrono::milliseconds(1000));
  Log(LogLevel::kInfo, "sidecar", "stopped");
}

Sidecar::~Sidecar() {
  if (data_) Stop();
}

}  // namespace tpusync
