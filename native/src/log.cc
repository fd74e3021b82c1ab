#include "log.h"

#include <chrono>
#include <cstdio>
#include <string>

namespace tpusync {

void Log(LogLevel level, std::string_view component, std::string_view message) {
  const char* name = level == LogLevel::kInfo ? "info" : level == LogLevel::kWarning ? "warning" : "error";
  auto now = std::chrono::system_clock::now().time_since_epoch();
  double ts = std::chrono::duration<double>(now).count();
  std::string msg(message);
  for (auto& ch : msg) {
    if (ch == '"') ch = '\'';
  }
  std::fprintf(stderr, "ts=%.6f level=%s component=%.*s msg=\"%s\"\n", ts, name, static_cast<int>(component.size()),
               component.data(), msg.c_str());
}

}  // namespace tpusync
