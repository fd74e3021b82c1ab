// FramedConn: frames over a Socket, validated before use, and the authenticated handshake.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "net/socket.h"
#include "tpusync/net/frame.h"

namespace tpusync::net {

struct Frame {
  FrameHeader header;
  std::vector<std::byte> body;
};

// The shared secret peers prove they know; never sent on the wire.
class Secret {
 public:
  static Result<Secret> FromFile(const std::string& path);
  explicit Secret(std::string bytes) : bytes_(std::move(bytes)) {}
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

class FramedConn {
 public:
  // `max_block` bounds the payload of kBlock frames this side accepts. The socket is
  // borrowed: its owner can Shutdown() it from another thread to cut a transfer off.
  FramedConn(Socket& socket, uint64_t max_block) : socket_(socket), max_block_(max_block) {}

  Status Send(Op op, std::span<const std::byte> body, Deadline d, uint32_t count = 0, uint16_t status = 0);
  Status SendError(const Status& st, Deadline d);
  // Receives a non-block frame and verifies its body checksum. An kError frame from the peer
  // comes back as the Status it carries.
  Result<Frame> Recv(Deadline d);
  // Recv, but the frame must be `op` (or kError) with a body of at most `max_body` bytes,
  // checked before the body is read.
  Result<Frame> Expect(Op op, Deadline d, uint64_t max_body = kMaxBodyBytes);

  // A data-port request: one of `ops` with a body of exactly 16 bytes per key and at most
  // kMaxKeys keys, both checked on the header, before anything is allocated for the body.
  Result<Frame> RecvKeyRequest(std::span<const Op> ops, Deadline d);

  // A block travels as a kBlock header, the payload, and an 8-byte XXH3 trailer computed
  // while the payload is sent, so it is checked end to end without a second pass.
  Status SendBlock(uint32_t index, const std::byte* data, uint64_t len, Deadline d);
  Status SendAbsent(uint32_t index, Deadline d);
  // The next kBlock or kEnd header (kError comes back as its Status).
  Result<FrameHeader> RecvBlockHeader(Deadline d);
  // Reads a payload into dst (or drops it when dst is null) and verifies the trailer; the
  // payload's XXH3-64, computed on the way in, goes to `digest` if given.
  Status RecvBlockPayload(std::byte* dst, uint64_t len, Deadline d, uint64_t* digest = nullptr);

  Socket& socket() { return socket_; }
  uint64_t max_block() const { return max_block_; }
  void set_max_block(uint64_t v) { max_block_ = v; }

 private:
  Result<FrameHeader> RecvHeader(Deadline d);
  Result<Frame> RecvBody(const FrameHeader& h, Deadline d);
  Socket& socket_;
  uint64_t max_block_;
};

// Mutual challenge-response over HMAC-SHA256 of both nonces. The server reads nothing but
// the handshake until the client has proven the secret. Both run against one deadline. On
// failure the server side returns the reason; its caller replies with it (SendError). Once
// the client has proven the secret, `admit` (if given) decides whether it is served:
// kResourceExhausted in place of AUTH_OK when it is not.
Status ServerHandshake(FramedConn& c, const Secret& secret, uint64_t block_bytes, Deadline d,
                       const std::function<bool()>& admit = nullptr);
// Returns the server's block size.
Result<uint64_t> ClientHandshake(FramedConn& c, const Secret& secret, Deadline d);

}  // namespace tpusync::net
