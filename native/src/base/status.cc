#include "tpusync/status.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "base/posix_io.h"
#include "tpusync/block_key.h"

namespace tpusync {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case StatusCode::kNotFound: return "NOT_FOUND";
    case StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case StatusCode::kDataLoss: return "DATA_LOSS";
    case StatusCode::kIoError: return "IO_ERROR";
    case StatusCode::kUnavailable: return "UNAVAILABLE";
    case StatusCode::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case StatusCode::kUnauthenticated: return "UNAUTHENTICATED";
    case StatusCode::kInternal: return "INTERNAL";
    case StatusCode::kMalformed: return "MALFORMED";
  }
  return "UNKNOWN";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(StatusCodeName(code_)) + ": " + message_;
}

Status ErrnoStatus(int err, std::string_view what) {
  std::string msg = std::string(what) + ": " + ErrnoMessage(err);
  if (err == ENOSPC || err == EDQUOT) return ResourceExhausted(std::move(msg));
  return {StatusCode::kIoError, std::move(msg)};
}

std::string BlockKey::ToHex() const {
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%016llx%016llx", static_cast<unsigned long long>(hi),
                static_cast<unsigned long long>(lo));
  return buf;
}

}  // namespace tpusync
