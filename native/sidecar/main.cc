// tpusync-sidecar: serves this host's block tiers to peers and to engines in the pod.
#include <signal.h>  // NOLINT(modernize-deprecated-headers): POSIX sigset_t, sigwait

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "base/log.h"
#include "sidecar/sidecar.h"

namespace {

int Run(int argc, char** argv) {
  using namespace tpusync;
  Result<SidecarFlags> flags = ParseSidecarFlags(std::vector<std::string>(argv + 1, argv + argc));
  if (!flags.ok()) {
    std::fprintf(stderr, "tpusync-sidecar: %s\n", flags.status().message().c_str());
    return 2;
  }
  if (flags->help) {
    std::fputs(SidecarUsage().c_str(), stdout);
    return 0;
  }
  // Signals are taken by sigwait below, never by a random thread.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  signal(SIGPIPE, SIG_IGN);

  Result<std::unique_ptr<Sidecar>> sidecar = Sidecar::Start(*flags);
  if (!sidecar.ok()) {
    Log(LogLevel::kError, "sidecar", "cannot start: " + sidecar.status().ToString());
    return 1;
  }
  std::printf("{\"event\":\"ready\",\"data_port\":%u,\"http_port\":%u}\n", (*sidecar)->data_port(),
              (*sidecar)->http_port());
  std::fflush(stdout);
  int sig = 0;
  sigwait(&sigs, &sig);
  Log(LogLevel::kInfo, "sidecar", std::string("received ") + (sig == SIGTERM ? "SIGTERM" : "SIGINT"));
  (*sidecar)->Stop();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const std::exception& e) {  // std::bad_alloc, say: exit with a message, not std::terminate
    std::fprintf(stderr, "tpusync-sidecar: %s\n", e.what());
    return 1;
  }
}
