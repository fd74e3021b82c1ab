// Sidecar: the host's tiers served to peers (data port), to engines in the pod (control
// socket) and to Kubernetes (HTTP probes and metrics).
#pragma once

#include <atomic>
#include <chrono>
#include <memory>

#include "net/control_service.h"
#include "net/peer_client.h"
#include "net/peer_service.h"
#include "net/server.h"
#include "sidecar/flags.h"
#include "sidecar/http.h"
#include "net/metrics.h"
#include "tpusync/store.h"

namespace tpusync {

class Sidecar {
 public:
  // Opens (or re-attaches to) the tiers and starts listening. Fails on a bad flag value, a
  // missing secret, a pool owned by another process, or a port in use.
  static Result<std::unique_ptr<Sidecar>> Start(const SidecarFlags& flags);
  ~Sidecar();

  // Graceful stop: /readyz turns 503, listeners close, in-flight transfers get the drain
  // period to finish, write-behind is flushed.
  void Stop();
  uint16_t data_port() const { return data_->port(); }
  uint16_t http_port() const { return http_->port(); }

 private:
  Sidecar() = default;
  HttpResponse Route(const std::string& path);

  SidecarFlags flags_;
  Metrics metrics_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<net::PeerPool> peers_;
  std::unique_ptr<net::PeerService> peer_service_;
  std::unique_ptr<net::ControlService> control_service_;
  std::unique_ptr<net::ConnectionServer> data_, control_, http_;
  std::atomic<bool> ready_{false};
};

}  // namespace tpusync
