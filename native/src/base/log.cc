#include "base/log.h"

#include <chrono>
#include <cstdio>
#include <string>

namespace tpusync {

void Log(LogLevel level, std::string_view component, std::string_view message) {
  const char* name = level == LogLevel::kInfo ? "info" : level == LogLevel::kWarning ? "warning" : "error";
  auto now = std::chrono::system_clock::now().time_since_epoch();
  double ts = std::chrono::duration<double>(now).count();
  // Messages can carry peer-supplied text: escape what could forge a line or a field.
  std::string msg;
  msg.reserve(message.size());
  for (unsigned char ch : message) {
    if (ch == '"' || ch == '\\') {
      msg += '\\';
      msg += static_cast<char>(ch);
    } else if (ch < 0x20 || ch == 0x7f) {
      char esc[5];
      std::snprintf(esc, sizeof esc, "\\x%02x", ch);
      msg += esc;
    } else {
      msg += static_cast<char>(ch);
    }
  }
  std::fprintf(stderr, "ts=%.6f level=%s component=%.*s msg=\"%s\"\n", ts, name, static_cast<int>(component.size()),
               component.data(), msg.c_str());
}

}  // namespace tpusync
