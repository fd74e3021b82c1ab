// Status and Result: the one error type at every boundary of the engine.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace tpusync {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,     // the caller passed something malformed
  kNotFound,            // a key or file that must exist does not
  kFailedPrecondition,  // the call is valid but not in the current state
  kResourceExhausted,   // no free slot, extent or disk space
  kDataLoss,            // a stored block failed its integrity check
  kIoError,             // the operating system refused an I/O call
  kUnavailable,         // a peer or service cannot be reached
  kDeadlineExceeded,
  kUnauthenticated,     // a peer failed the shared-secret handshake
  kInternal,
  kMalformed,           // a peer's bytes break the wire protocol: the channel is out of step
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status FailedPrecondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
inline Status ResourceExhausted(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
inline Status DataLoss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

// An I/O failure: the message names the operation, the path and strerror(err).
// ENOSPC and EDQUOT become kResourceExhausted so a full disk reads as such.
Status ErrnoStatus(int err, std::string_view what);

// A value or the Status that explains its absence.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}                // NOLINT: implicit by design
  // An OK status carries no value: it becomes kInternal, so ok() and status() never disagree.
  Result(Status status)  // NOLINT: implicit by design
      : v_(status.ok() ? Internal("a Result was built from an OK status and no value") : std::move(status)) {}
  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  T* operator->() { return &value(); }

 private:
  std::variant<T, Status> v_;
};

#define TPUSYNC_CONCAT_INNER(a, b) a##b
#define TPUSYNC_CONCAT(a, b) TPUSYNC_CONCAT_INNER(a, b)

#define TPUSYNC_RETURN_IF_ERROR(expr)          \
  do {                                         \
    ::tpusync::Status _st = (expr);            \
    if (!_st.ok()) return _st;                 \
  } while (0)

// `lhs` may be a declaration (`auto x`), which parentheses would break; `tmp` is a name the
// macro below makes.
// NOLINTBEGIN(bugprone-macro-parentheses)
#define TPUSYNC_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(tmp).value()
// NOLINTEND(bugprone-macro-parentheses)

#define TPUSYNC_ASSIGN_OR_RETURN(lhs, expr) \
  TPUSYNC_ASSIGN_OR_RETURN_IMPL(TPUSYNC_CONCAT(_result_, __LINE__), lhs, expr)

}  // namespace tpusync
