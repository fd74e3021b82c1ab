// FramedConn: frames over a Socket, validated before use, and the authenticated handshake
// that turns a data-port connection into a sealed session (net/session.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "net/session.h"
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

  // From now on every frame is sealed under `cipher` both ways (the handshakes call this).
  void Seal(std::unique_ptr<SessionCipher> cipher) { cipher_ = std::move(cipher); }
  bool sealed() const { return cipher_ != nullptr; }
  // Each frame must then be sent, or arrive, whole within `t` of its start (on top of the
  // caller's deadline): a peer that stops reading or writing mid-transfer loses the
  // connection, and whatever slot or lease it held, in seconds instead of at the request's
  // deadline. Zero: the caller's deadline only.
  void set_progress_timeout(std::chrono::milliseconds t) { progress_ = t; }

  Status Send(Op op, std::span<const std::byte> body, Deadline d, uint32_t count = 0, uint16_t status = 0);
  Status SendError(const Status& st, Deadline d);
  // Receives a non-block frame and verifies its body (checksum, or tag when sealed). An
  // kError frame from the peer comes back as the Status it carries.
  Result<Frame> Recv(Deadline d);
  // Whether the last Recv or Expect that failed still consumed a whole frame (the peer's ERROR
  // reply): the channel is in step and may carry the next request.
  bool in_step() const { return in_step_; }
  // Recv, but the frame must be `op` (or kError) with a body of at most `max_body` bytes,
  // checked before the body is read.
  Result<Frame> Expect(Op op, Deadline d, uint64_t max_body = kMaxBodyBytes);

  // A data-port request: one of `ops` with a body of exactly 16 bytes per key and at most
  // kMaxKeys keys, both checked on the header, before anything is allocated for the body.
  Result<Frame> RecvKeyRequest(std::span<const Op> ops, Deadline d);

  // A block travels as a kBlock header, the payload and the frame's tag, computed while the
  // payload is sent, so it is checked end to end without a second pass. Sealed sessions only.
  Status SendBlock(uint32_t index, const std::byte* data, uint64_t len, Deadline d);
  Status SendAbsent(uint32_t index, Deadline d);
  // The next kBlock or kEnd header (kError comes back as its Status). An absent block's
  // frame is verified whole here; a present one's payload must follow with RecvBlockPayload.
  Result<FrameHeader> RecvBlockHeader(Deadline d);
  // Waits until the payload of the block whose header just arrived starts to arrive, so no
  // slot is reserved for a peer that sends a header and stalls.
  Status AwaitPayload(Deadline d);
  // Reads a payload into dst (or drops it when dst is null) and verifies the tag. With
  // `digest`, the payload's XXH3-64 is computed on the way in, while each piece is in cache.
  // The read that ends the payload takes the tag, and the start of the next frame's header if
  // it has arrived (a block's frame is always followed by another: BLOCK, END or ERROR).
  Status RecvBlockPayload(std::byte* dst, uint64_t len, Deadline d, uint64_t* digest = nullptr);

  // Waits for the next frame: true at once when its start was read already (RecvBlockPayload),
  // false if `wake_fd` fired first.
  Result<bool> WaitReadable(int wake_fd, Deadline d);

  Socket& socket() { return socket_; }
  uint64_t max_block() const { return max_block_; }
  void set_max_block(uint64_t v) { max_block_ = v; }

 private:
  Deadline FrameDeadline(Deadline d) const;
  Result<FrameHeader> RecvHeader(Deadline d);
  Result<Frame> RecvBody(const FrameHeader& h);
  Status RecvTag();
  Socket& socket_;
  uint64_t max_block_;
  std::unique_ptr<SessionCipher> cipher_;
  std::chrono::milliseconds progress_{0};
  Deadline recv_deadline_ = Deadline::Never();  // the frame being received
  // The start of the next frame's header, read with the end of a block's payload.
  std::byte ahead_[kHeaderBytes];
  size_t ahead_len_ = 0;
  bool in_step_ = true;
};

// What each side brings to the handshake.
struct HandshakeOptions {
  // The server: its pool's block size. A client: the block size its pool holds, which the
  // server's must equal, or 0 to take the server's (a client without a pool).
  uint64_t block_bytes = 0;
  // A client: ask for an encrypted session. The server: require one, whatever the client asks.
  bool encrypt = false;
};

// The client's proof and the server's are HMAC-SHA256 under the pool's secret of the whole
// handshake transcript (both nonces, block sizes and flags), and each direction's session key
// is derived the same way, so the connection is sealed from the first request on. The server
// reads nothing but the handshake until the client has proven the secret, and refuses a client
// whose pool holds blocks of another size, naming both. Both run against one deadline. On
// failure the server side returns the reason; its caller replies with it (SendError). Once the
// client has proven the secret, `admit` (if given) decides whether it is served: its refusal
// goes back in place of AUTH_OK.
Status ServerHandshake(FramedConn& c, const Secret& secret, const HandshakeOptions& options, Deadline d,
                       const std::function<Status()>& admit = nullptr);
// Returns the server's block size, which bounds the blocks `c` accepts from now on.
Result<uint64_t> ClientHandshake(FramedConn& c, const Secret& secret, const HandshakeOptions& options, Deadline d);

}  // namespace tpusync::net
