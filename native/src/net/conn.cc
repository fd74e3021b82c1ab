#include "net/conn.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>
#include <utility>

#include "base/checksum.h"
#include "base/mac.h"

namespace tpusync::net {
namespace {

constexpr uint64_t kChunk = 256 << 10;  // checksum and send/receive in cache-sized pieces

// HMAC-SHA256(secret, label || transcript): the proofs and the session keys.
Result<std::vector<std::byte>> Mac(const Secret& secret, std::string_view label, std::span<const std::byte> transcript) {
  TPUSYNC_ASSIGN_OR_RETURN(MacKey mac, HmacSha256(std::as_bytes(std::span(secret.bytes())), label, transcript));
  static_assert(kMacBytes == kMacKeyBytes);
  return std::vector<std::byte>(mac.begin(), mac.end());
}

Result<std::vector<std::byte>> Nonce() {
  std::vector<std::byte> n(kNonceBytes);
  TPUSYNC_RETURN_IF_ERROR(RandomBytes(n));
  return n;
}

// HELLO and CHALLENGE bodies: a nonce, a block size, flags.
constexpr uint64_t kHandshakeBodyBytes = kNonceBytes + 16;
constexpr uint64_t kFlagEncrypt = 1;

std::vector<std::byte> HandshakeBody(std::span<const std::byte> nonce, uint64_t block_bytes, uint64_t flags) {
  BodyWriter w;
  w.Bytes(nonce);
  w.U64(block_bytes);
  w.U64(flags);
  return std::move(w.bytes());
}

struct HandshakeFields {
  std::span<const std::byte> nonce;
  uint64_t block_bytes = 0, flags = 0;
};

Result<HandshakeFields> ParseHandshakeBody(const Frame& f) {
  BodyReader r(f.body);
  HandshakeFields h;
  if (!r.Bytes(kNonceBytes, &h.nonce) || !r.U64(&h.block_bytes) || !r.U64(&h.flags) || !r.done()) {
    return BadFrame(std::string(OpName(f.header.op)) + " body");
  }
  if ((h.flags & ~kFlagEncrypt) != 0) return BadFrame(std::string(OpName(f.header.op)) + " has unknown flags");
  return h;
}

Status SameBlockSize(uint64_t mine, uint64_t theirs, std::string_view who) {
  if (mine == 0 || theirs == 0 || mine == theirs) return Status::Ok();
  return FailedPrecondition("block size mismatch: this side's pool holds " + std::to_string(mine) + "-byte blocks, " +
                            std::string(who) + "'s " + std::to_string(theirs) +
                            "-byte blocks; every member of a pool must run with the same --block-bytes");
}

// The session keys of both directions, derived from the transcript; `client` picks which is
// this side's sending key.
Result<std::unique_ptr<SessionCipher>> SessionFor(const Secret& secret, std::span<const std::byte> transcript,
                                                  bool client, bool encrypt) {
  TPUSYNC_ASSIGN_OR_RETURN(auto c2s, Mac(secret, "tpusync/3 key client->server", transcript));
  TPUSYNC_ASSIGN_OR_RETURN(auto s2c, Mac(secret, "tpusync/3 key server->client", transcript));
  SessionKey up, down;
  std::copy_n(c2s.begin(), kKeyBytes, up.begin());
  std::copy_n(s2c.begin(), kKeyBytes, down.begin());
  return client ? std::make_unique<SessionCipher>(up, down, encrypt) : std::make_unique<SessionCipher>(down, up, encrypt);
}

std::vector<std::byte> Transcript(std::span<const std::byte> hello, std::span<const std::byte> challenge) {
  std::vector<std::byte> t(hello.begin(), hello.end());
  t.insert(t.end(), challenge.begin(), challenge.end());
  return t;
}

}  // namespace

Result<Secret> Secret::FromFile(const std::string& path) {
  struct stat st{};
  if (::stat(path.c_str(), &st) == 0 && (st.st_mode & (S_IROTH | S_IWOTH)) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return FailedPrecondition("auth secret file " + path + " is open to other users (mode " + mode +
                              "): chmod 600 it (640 or 440 to share it with a group)");
  }
  std::ifstream f(path, std::ios::binary);
  if (!f) return NotFound("auth secret file " + path + " cannot be read");
  std::stringstream ss;
  ss << f.rdbuf();
  std::string s = ss.str();
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  if (s.size() < 16) return InvalidArgument("auth secret in " + path + " is shorter than 16 bytes");
  return Secret(std::move(s));
}

Deadline FramedConn::FrameDeadline(Deadline d) const {
  return progress_.count() > 0 ? Deadline::Earliest(d, Deadline::After(progress_)) : d;
}

Status FramedConn::Send(Op op, std::span<const std::byte> body, Deadline d, uint32_t count, uint16_t status) {
  const Deadline fd = FrameDeadline(d);
  FrameHeader h;
  h.op = op;
  h.status = status;
  h.count = count;
  h.body_len = body.size();
  h.body_sum = sealed() ? 0 : Checksum(body.data(), body.size());
  std::byte hdr[kHeaderBytes];
  EncodeHeader(h, hdr);
  if (!sealed()) {
    struct iovec iov[2] = {{hdr, kHeaderBytes}, {const_cast<std::byte*>(body.data()), body.size()}};
    return socket_.WriteVFull(iov, body.empty() ? 1 : 2, fd);
  }
  std::vector<std::byte> cipher_text(cipher_->encrypts() ? body.size() : 0);
  std::byte tag[kTagBytes];
  TPUSYNC_RETURN_IF_ERROR(cipher_->BeginSeal(std::span(hdr, kHeaderBytes)));
  TPUSYNC_RETURN_IF_ERROR(cipher_->SealPart(body.data(), cipher_text.data(), body.size()));
  TPUSYNC_RETURN_IF_ERROR(cipher_->EndSeal(tag));
  const std::byte* out = cipher_->encrypts() ? cipher_text.data() : body.data();
  struct iovec iov[3] = {{hdr, kHeaderBytes}, {const_cast<std::byte*>(out), body.size()}, {tag, kTagBytes}};
  if (body.empty()) iov[1] = iov[2];
  return socket_.WriteVFull(iov, body.empty() ? 2 : 3, fd);
}

Status FramedConn::SendError(const Status& st, Deadline d) {
  std::string msg = st.message().substr(0, kMaxErrorBytes);
  return Send(Op::kError, std::as_bytes(std::span(msg)), d, 0, static_cast<uint16_t>(st.code()));
}

Result<FrameHeader> FramedConn::RecvHeader(Deadline d) {
  in_step_ = false;  // until a whole ERROR reply says otherwise
  recv_deadline_ = FrameDeadline(d);
  std::byte hdr[kHeaderBytes];
  const size_t ahead = std::exchange(ahead_len_, 0);
  std::copy_n(ahead_, ahead, hdr);
  TPUSYNC_RETURN_IF_ERROR(socket_.ReadFull(hdr + ahead, kHeaderBytes - ahead, recv_deadline_));
  TPUSYNC_ASSIGN_OR_RETURN(FrameHeader h, DecodeHeader(hdr, max_block_));
  if (sealed()) {
    if (h.body_sum != 0) return BadFrame("body_sum must be 0 in a sealed session");
    TPUSYNC_RETURN_IF_ERROR(cipher_->BeginOpen(std::span(hdr, kHeaderBytes)));
  }
  return h;
}

Status FramedConn::RecvTag() {
  std::byte tag[kTagBytes];
  TPUSYNC_RETURN_IF_ERROR(socket_.ReadFull(tag, kTagBytes, recv_deadline_));
  return cipher_->EndOpen(tag);
}

Result<Frame> FramedConn::RecvBody(const FrameHeader& h) {
  Frame f{h, std::vector<std::byte>(h.body_len)};
  TPUSYNC_RETURN_IF_ERROR(socket_.ReadFull(f.body.data(), f.body.size(), recv_deadline_));
  if (sealed()) {
    TPUSYNC_RETURN_IF_ERROR(cipher_->OpenPart(f.body.data(), f.body.size()));
    TPUSYNC_RETURN_IF_ERROR(RecvTag());
  } else if (Checksum(f.body.data(), f.body.size()) != h.body_sum) {
    return BadFrame("body checksum mismatch");
  }
  if (h.op == Op::kError) {
    auto code = static_cast<StatusCode>(h.status);
    if (code == StatusCode::kOk || h.status > static_cast<uint16_t>(StatusCode::kMalformed)) code = StatusCode::kInternal;
    in_step_ = true;  // an ERROR reply arrived whole
    return Status(code, "peer: " + std::string(reinterpret_cast<const char*>(f.body.data()), f.body.size()));
  }
  return f;
}

Result<Frame> FramedConn::Recv(Deadline d) {
  TPUSYNC_ASSIGN_OR_RETURN(FrameHeader h, RecvHeader(d));
  if (h.op == Op::kBlock) return BadFrame("unexpected BLOCK");
  return RecvBody(h);
}

Result<Frame> FramedConn::Expect(Op op, Deadline d, uint64_t max_body) {
  TPUSYNC_ASSIGN_OR_RETURN(FrameHeader h, RecvHeader(d));
  // Op and size are checked on the header, so an unexpected or oversized body is never read.
  if (h.op == Op::kError) {
    if (h.body_len > kMaxErrorBytes) return BadFrame("ERROR body too large");
    return RecvBody(h).status();
  }
  if (h.op != op) {
    return BadFrame("expected " + std::string(OpName(op)) + ", got op " +
                    std::to_string(static_cast<uint16_t>(h.op)));
  }
  if (h.body_len > max_body) {
    return BadFrame(std::string(OpName(op)) + " body of " + std::to_string(h.body_len) +
                    " bytes, at most " + std::to_string(max_body) + " expected");
  }
  return RecvBody(h);
}

Result<Frame> FramedConn::RecvKeyRequest(std::span<const Op> ops, Deadline d) {
  TPUSYNC_ASSIGN_OR_RETURN(FrameHeader h, RecvHeader(d));
  if (std::find(ops.begin(), ops.end(), h.op) == ops.end()) {
    return BadFrame("op " + std::to_string(static_cast<uint16_t>(h.op)) + " is not a request here");
  }
  if (h.count > kMaxKeys || h.body_len != uint64_t{h.count} * 16) {
    return BadFrame(std::string(OpName(h.op)) + " declares " + std::to_string(h.count) + " keys and " +
                    std::to_string(h.body_len) + " body bytes; 16 bytes per key and at most " +
                    std::to_string(kMaxKeys) + " keys");
  }
  return RecvBody(h);
}

Status FramedConn::SendBlock(uint32_t index, const std::byte* data, uint64_t len, Deadline d) {
  if (!sealed()) return FailedPrecondition("blocks travel only in a sealed session");
  const Deadline fd = FrameDeadline(d);
  FrameHeader h;
  h.op = Op::kBlock;
  h.count = index;
  h.body_len = len;
  std::byte hdr[kHeaderBytes];
  EncodeHeader(h, hdr);
  TPUSYNC_RETURN_IF_ERROR(cipher_->BeginSeal(std::span(hdr, kHeaderBytes)));
  // Authenticated only, each piece is MACed right after the kernel copied it into the socket,
  // while it is still in this core's cache (the kernel's copy reads memory faster than the MAC
  // would). The tag still covers the bytes that were sent: the block is pinned by its lease and
  // immutable once committed; were it to change in between, the receiver would refuse the
  // block, never accept it. Encrypted, each piece is sealed into a scratch buffer and sent from
  // there. The header goes out with the first piece, one syscall fewer per block.
  std::vector<std::byte> scratch(cipher_->encrypts() ? std::min(kChunk, len) : 0);
  uint64_t off = 0;
  do {
    const uint64_t n = std::min(kChunk, len - off);
    const std::byte* out = data + off;
    if (cipher_->encrypts()) {
      TPUSYNC_RETURN_IF_ERROR(cipher_->SealPart(data + off, scratch.data(), n));
      out = scratch.data();
    }
    struct iovec iov[2] = {{const_cast<std::byte*>(out), n}, {}};
    int iovcnt = 1;
    if (off == 0) {
      iov[1] = iov[0];
      iov[0] = {hdr, kHeaderBytes};
      iovcnt = 2;
    }
    TPUSYNC_RETURN_IF_ERROR(socket_.WriteVFull(iov, iovcnt, fd));
    if (!cipher_->encrypts()) TPUSYNC_RETURN_IF_ERROR(cipher_->SealPart(data + off, nullptr, n));
    off += n;
  } while (off < len);
  std::byte tag[kTagBytes];
  TPUSYNC_RETURN_IF_ERROR(cipher_->EndSeal(tag));
  return socket_.WriteFull(tag, kTagBytes, fd);
}

Status FramedConn::SendAbsent(uint32_t index, Deadline d) { return Send(Op::kBlock, {}, d, index, 1); }

Result<FrameHeader> FramedConn::RecvBlockHeader(Deadline d) {
  TPUSYNC_ASSIGN_OR_RETURN(FrameHeader h, RecvHeader(d));
  if (h.op == Op::kBlock) {
    if (!sealed()) return BadFrame("BLOCK outside a sealed session");
    if (h.status != 0 && h.body_len != 0) return BadFrame("absent BLOCK with a payload");
    if (h.status == 0 && h.body_len == 0) return BadFrame("empty BLOCK");
    if (h.status != 0) TPUSYNC_RETURN_IF_ERROR(RecvTag());
    return h;
  }
  if (h.op != Op::kEnd && h.op != Op::kError) return BadFrame("expected BLOCK or END");
  if (h.body_len > kMaxErrorBytes) return BadFrame("END/ERROR body too large");
  TPUSYNC_RETURN_IF_ERROR(RecvBody(h).status());
  return h;
}

Status FramedConn::AwaitPayload(Deadline d) {
  Result<bool> readable = socket_.WaitReadable(-1, Deadline::Earliest(d, recv_deadline_));
  if (readable.ok() && *readable) return Status::Ok();
  if (!readable.ok() && readable.status().code() != StatusCode::kDeadlineExceeded) return readable.status();
  return Status(StatusCode::kDeadlineExceeded, "no payload within the progress timeout after a BLOCK header");
}

Status FramedConn::RecvBlockPayload(std::byte* dst, uint64_t len, Deadline d, uint64_t* digest) {
  if (!sealed()) return FailedPrecondition("blocks travel only in a sealed session");
  const Deadline rd = Deadline::Earliest(d, recv_deadline_);
  std::optional<StreamingChecksum> sum;
  if (digest != nullptr) sum.emplace();
  std::vector<std::byte> scratch(dst == nullptr ? std::min(kChunk, len) : 0);
  std::byte tag[kTagBytes];
  uint64_t off = 0;
  do {
    const uint64_t n = std::min(kChunk, len - off);
    std::byte* p = dst != nullptr ? dst + off : scratch.data();
    if (off + n < len) {
      TPUSYNC_RETURN_IF_ERROR(socket_.ReadFull(p, n, rd));
    } else {  // the last piece, the tag, and what has come of the next header (none is pending)
      struct iovec iov[3] = {{p, n}, {tag, kTagBytes}, {ahead_, kHeaderBytes}};
      TPUSYNC_ASSIGN_OR_RETURN(size_t got, socket_.ReadVAtLeast(iov, 3, n + kTagBytes, rd));
      ahead_len_ = got - n - kTagBytes;
    }
    TPUSYNC_RETURN_IF_ERROR(cipher_->OpenPart(p, n));
    if (sum) sum->Update(p, n);
    off += n;
  } while (off < len);
  TPUSYNC_RETURN_IF_ERROR(cipher_->EndOpen(tag));
  if (digest != nullptr) *digest = sum->Digest();
  return Status::Ok();
}

Result<bool> FramedConn::WaitReadable(int wake_fd, Deadline d) {
  if (ahead_len_ > 0) return true;
  return socket_.WaitReadable(wake_fd, d);
}

Status ServerHandshake(FramedConn& c, const Secret& secret, const HandshakeOptions& options, Deadline d,
                       const std::function<Status()>& admit) {
  TPUSYNC_ASSIGN_OR_RETURN(Frame hello, c.Expect(Op::kHello, d, kHandshakeBodyBytes));
  TPUSYNC_ASSIGN_OR_RETURN(HandshakeFields client, ParseHandshakeBody(hello));
  TPUSYNC_RETURN_IF_ERROR(SameBlockSize(options.block_bytes, client.block_bytes, "the client"));
  const bool encrypt = options.encrypt || (client.flags & kFlagEncrypt) != 0;
  TPUSYNC_ASSIGN_OR_RETURN(std::vector<std::byte> server_nonce, Nonce());
  std::vector<std::byte> challenge = HandshakeBody(server_nonce, options.block_bytes, encrypt ? kFlagEncrypt : 0);
  TPUSYNC_RETURN_IF_ERROR(c.Send(Op::kChallenge, challenge, d));
  const std::vector<std::byte> transcript = Transcript(hello.body, challenge);
  TPUSYNC_ASSIGN_OR_RETURN(Frame auth, c.Expect(Op::kAuth, d, kMacBytes));
  TPUSYNC_ASSIGN_OR_RETURN(auto want, Mac(secret, "tpusync/3 client proof", transcript));
  if (!ConstantTimeEqual(auth.body, want)) {
    return Status(StatusCode::kUnauthenticated, "authentication failed: the peer does not hold this pool's secret");
  }
  if (admit) TPUSYNC_RETURN_IF_ERROR(admit());
  TPUSYNC_ASSIGN_OR_RETURN(auto proof, Mac(secret, "tpusync/3 server proof", transcript));
  TPUSYNC_ASSIGN_OR_RETURN(auto session, SessionFor(secret, transcript, false, encrypt));
  TPUSYNC_RETURN_IF_ERROR(c.Send(Op::kAuthOk, proof, d));
  c.Seal(std::move(session));
  return Status::Ok();
}

Result<uint64_t> ClientHandshake(FramedConn& c, const Secret& secret, const HandshakeOptions& options, Deadline d) {
  TPUSYNC_ASSIGN_OR_RETURN(std::vector<std::byte> client_nonce, Nonce());
  std::vector<std::byte> hello = HandshakeBody(client_nonce, options.block_bytes, options.encrypt ? kFlagEncrypt : 0);
  TPUSYNC_RETURN_IF_ERROR(c.Send(Op::kHello, hello, d));
  TPUSYNC_ASSIGN_OR_RETURN(Frame ch, c.Expect(Op::kChallenge, d, kHandshakeBodyBytes));
  TPUSYNC_ASSIGN_OR_RETURN(HandshakeFields server, ParseHandshakeBody(ch));
  TPUSYNC_RETURN_IF_ERROR(SameBlockSize(options.block_bytes, server.block_bytes, "the server"));
  if (server.block_bytes == 0) return BadFrame("CHALLENGE names no block size");
  const bool encrypt = (server.flags & kFlagEncrypt) != 0;
  if (options.encrypt && !encrypt) return BadFrame("the server did not agree to encrypt the session");
  const std::vector<std::byte> transcript = Transcript(hello, ch.body);
  TPUSYNC_ASSIGN_OR_RETURN(auto proof, Mac(secret, "tpusync/3 client proof", transcript));
  TPUSYNC_RETURN_IF_ERROR(c.Send(Op::kAuth, proof, d));
  auto ok = c.Expect(Op::kAuthOk, d, kMacBytes);
  if (!ok.ok()) {
    if (ok.status().code() == StatusCode::kUnavailable) {
      return Status(StatusCode::kUnauthenticated, "authentication failed: the peer closed the connection");
    }
    return ok.status();
  }
  TPUSYNC_ASSIGN_OR_RETURN(auto want, Mac(secret, "tpusync/3 server proof", transcript));
  if (!ConstantTimeEqual(ok->body, want)) {
    return Status(StatusCode::kUnauthenticated, "authentication failed: the server does not hold this pool's secret");
  }
  TPUSYNC_ASSIGN_OR_RETURN(auto session, SessionFor(secret, transcript, true, encrypt));
  c.Seal(std::move(session));
  c.set_max_block(server.block_bytes);
  return server.block_bytes;
}

}  // namespace tpusync::net
