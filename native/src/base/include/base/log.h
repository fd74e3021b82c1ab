// Structured one-line logs on stderr: `ts=... level=... component=... msg="..."`.
#pragma once

#include <string_view>

namespace tpusync {

enum class LogLevel { kInfo, kWarning, kError };

void Log(LogLevel level, std::string_view component, std::string_view message);

}  // namespace tpusync
