#include "net/conn.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "checksum.h"

namespace tpusync::net {
namespace {

constexpr uint64_t kChunk = 256 << 10;  // checksum and send/receive in cache-sized pieces

Status BadFrame(const std::string& why) { return InvalidArgument("bad frame: " + why); }

Result<std::vector<std::byte>> Mac(const Secret& secret, std::string_view label, std::span<const std::byte> a,
                                   std::span<const std::byte> b) {
  std::vector<std::byte> msg;
  msg.insert(msg.end(), reinterpret_cast<const std::byte*>(label.data()),
             reinterpret_cast<const std::byte*>(label.data()) + label.size());
  msg.insert(msg.end(), a.begin(), a.end());
  msg.insert(msg.end(), b.begin(), b.end());
  std::vector<std::byte> out(kMacBytes);
  size_t out_len = 0;
  if (EVP_Q_mac(nullptr, "HMAC", nullptr, "SHA256", nullptr, secret.bytes().data(), secret.bytes().size(),
                reinterpret_cast<const unsigned char*>(msg.data()), msg.size(),
                reinterpret_cast<unsigned char*>(out.data()), out.size(), &out_len) == nullptr ||
      out_len != kMacBytes) {
    return Internal("HMAC-SHA256 failed");
  }
  return out;
}

std::vector<std::byte> Nonce() {
  std::vector<std::byte> n(kNonceBytes);
  RAND_bytes(reinterpret_cast<unsigned char*>(n.data()), static_cast<int>(n.size()));
  return n;
}

bool SameMac(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace

Result<Secret> Secret::FromFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return NotFound("auth secret file " + path + " cannot be read");
  std::stringstream ss;
  ss << f.rdbuf();
  std::string s = ss.str();
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  if (s.size() < 16) return InvalidArgument("auth secret in " + path + " is shorter than 16 bytes");
  return Secret(std::move(s));
}

Status FramedConn::Send(Op op, std::span<const std::byte> body, Deadline d, uint32_t count, uint16_t status) {
  FrameHeader h;
  h.op = op;
  h.status = status;
  h.count = count;
  h.body_len = body.size();
  h.body_sum = Checksum(body.data(), body.size());
  std::byte hdr[kHeaderBytes];
  EncodeHeader(h, hdr);
  struct iovec iov[2] = {{hdr, kHeaderBytes}, {const_cast<std::byte*>(body.data()), body.size()}};
  return socket_.WriteVFull(iov, body.empty() ? 1 : 2, d);
}

Status FramedConn::SendError(const Status& st, Deadline d) {
  std::string msg = st.message().substr(0, kMaxErrorBytes);
  return Send(Op::kError, std::as_bytes(std::span(msg)), d, 0, static_cast<uint16_t>(st.code()));
}

Result<FrameHeader> FramedConn::RecvHeader(Deadline d) {
  std::byte hdr[kHeaderBytes];
  TPUSYNC_RETURN_IF_ERROR(socket_.ReadFull(hdr, kHeaderBytes, d));
  return DecodeHeader(hdr, max_block_);
}

Result<Frame> FramedConn::RecvBody(const FrameHeader& h, Deadline d) {
  Frame f{h, std::vector<std::byte>(h.body_len)};
  TPUSYNC_RETURN_IF_ERROR(socket_.ReadFull(f.body.data(), f.body.size(), d));
  if (Checksum(f.body.data(), f.body.size()) != h.body_sum) return BadFrame("body checksum mismatch");
  if (h.op == Op::kError) {
    auto code = static_cast<StatusCode>(std::min<uint16_t>(h.status, static_cast<uint16_t>(StatusCode::kInternal)));
    if (code == StatusCode::kOk) code = StatusCode::kInternal;
    return Status(code, "peer: " + std::string(reinterpret_cast<const char*>(f.body.data()), f.body.size()));
  }
  return f;
}

Result<Frame> FramedConn::Recv(Deadline d) {
  TPUSYNC_ASSIGN_OR_RETURN(FrameHeader h, RecvHeader(d));
  if (h.op == Op::kBlock) return BadFrame("unexpected BLOCK");
  return RecvBody(h, d);
}

Result<Frame> FramedConn::Expect(Op op, Deadline d, uint64_t max_body) {
  TPUSYNC_ASSIGN_OR_RETURN(FrameHeader h, RecvHeader(d));
  // Op and size are checked on the header, so an unexpected or oversized body is never read.
  if (h.op == Op::kError) {
    if (h.body_len > kMaxErrorBytes) return BadFrame("ERROR body too large");
    return RecvBody(h, d).status();
  }
  if (h.op != op) {
    return BadFrame("expected " + std::string(OpName(op)) + ", got op " +
                    std::to_string(static_cast<uint16_t>(h.op)));
  }
  if (h.body_len > max_body) {
    return BadFrame(std::string(OpName(op)) + " body of " + std::to_string(h.body_len) +
                    " bytes, at most " + std::to_string(max_body) + " expected");
  }
  return RecvBody(h, d);
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
  return RecvBody(h, d);
}

Status FramedConn::SendBlock(uint32_t index, const std::byte* data, uint64_t len, Deadline d) {
  FrameHeader h;
  h.op = Op::kBlock;
  h.count = index;
  h.body_len = len;
  std::byte hdr[kHeaderBytes];
  EncodeHeader(h, hdr);
  // Each chunk is hashed right after the kernel copied it into the socket, while it is still
  // in this core's cache: hashing first would pay the read from DRAM a second time (it was
  // a third of the sender's CPU). The trailer is still the XXH3 of the bytes that were sent:
  // the block is pinned by its lease and immutable once committed, so the bytes hashed are
  // the bytes the kernel copied; were they to change in between, the receiver would see a
  // mismatch and drop the block, never accept it. A block already corrupt in this DRAM before
  // the send is not caught here, exactly as when it was hashed first; the receiver verifies
  // what lands against this trailer, and weight versions against their manifest. The header
  // goes out with the first chunk, one syscall fewer per block.
  StreamingChecksum sum;
  uint64_t off = 0;
  do {
    const uint64_t n = std::min(kChunk, len - off);
    struct iovec iov[2] = {{const_cast<std::byte*>(data + off), n}, {}};
    int iovcnt = 1;
    if (off == 0) {
      iov[1] = iov[0];
      iov[0] = {hdr, kHeaderBytes};
      iovcnt = 2;
    }
    TPUSYNC_RETURN_IF_ERROR(socket_.WriteVFull(iov, iovcnt, d));
    sum.Update(data + off, n);
    off += n;
  } while (off < len);
  std::byte trailer[8];
  uint64_t digest = sum.Digest();
  for (int i = 0; i < 8; ++i) trailer[i] = static_cast<std::byte>(digest >> (8 * i));
  return socket_.WriteFull(trailer, 8, d);
}

Status FramedConn::SendAbsent(uint32_t index, Deadline d) { return Send(Op::kBlock, {}, d, index, 1); }

Result<FrameHeader> FramedConn::RecvBlockHeader(Deadline d) {
  TPUSYNC_ASSIGN_OR_RETURN(FrameHeader h, RecvHeader(d));
  if (h.op == Op::kBlock) {
    if (h.status != 0 && h.body_len != 0) return BadFrame("absent BLOCK with a payload");
    if (h.status == 0 && h.body_len == 0) return BadFrame("empty BLOCK");
    return h;
  }
  if (h.op != Op::kEnd && h.op != Op::kError) return BadFrame("expected BLOCK or END");
  if (h.body_len > kMaxErrorBytes) return BadFrame("END/ERROR body too large");
  TPUSYNC_RETURN_IF_ERROR(RecvBody(h, d).status());
  return h;
}

Status FramedConn::RecvBlockPayload(std::byte* dst, uint64_t len, Deadline d, uint64_t* digest) {
  StreamingChecksum sum;
  std::vector<std::byte> scratch(dst == nullptr ? std::min(kChunk, len) : 0);
  for (uint64_t off = 0; off < len; off += kChunk) {
    uint64_t n = std::min(kChunk, len - off);
    std::byte* p = dst != nullptr ? dst + off : scratch.data();
    TPUSYNC_RETURN_IF_ERROR(socket_.ReadFull(p, n, d));
    sum.Update(p, n);
  }
  std::byte trailer[8];
  TPUSYNC_RETURN_IF_ERROR(socket_.ReadFull(trailer, 8, d));
  uint64_t want = 0;
  for (int i = 0; i < 8; ++i) want |= uint64_t{std::to_integer<uint8_t>(trailer[i])} << (8 * i);
  if (want != sum.Digest()) return BadFrame("block payload checksum mismatch");
  if (digest != nullptr) *digest = want;
  return Status::Ok();
}

Status ServerHandshake(FramedConn& c, const Secret& secret, uint64_t block_bytes, Deadline d,
                       const std::function<bool()>& admit) {
  TPUSYNC_ASSIGN_OR_RETURN(Frame hello, c.Expect(Op::kHello, d, kNonceBytes));
  if (hello.body.size() != kNonceBytes) return BadFrame("HELLO nonce size");
  std::vector<std::byte> server_nonce = Nonce();
  BodyWriter w;
  w.Bytes(server_nonce);
  w.U64(block_bytes);
  TPUSYNC_RETURN_IF_ERROR(c.Send(Op::kChallenge, w.bytes(), d));
  TPUSYNC_ASSIGN_OR_RETURN(Frame auth, c.Expect(Op::kAuth, d, kMacBytes));
  TPUSYNC_ASSIGN_OR_RETURN(auto want, Mac(secret, "tpusync/1 client", server_nonce, hello.body));
  if (!SameMac(auth.body, want)) {
    return Status(StatusCode::kUnauthenticated, "authentication failed: the peer does not hold this pool's secret");
  }
  if (admit && !admit()) return ResourceExhausted("at its connection limit; try again later");
  TPUSYNC_ASSIGN_OR_RETURN(auto proof, Mac(secret, "tpusync/1 server", hello.body, server_nonce));
  return c.Send(Op::kAuthOk, proof, d);
}

Result<uint64_t> ClientHandshake(FramedConn& c, const Secret& secret, Deadline d) {
  std::vector<std::byte> client_nonce = Nonce();
  TPUSYNC_RETURN_IF_ERROR(c.Send(Op::kHello, client_nonce, d));
  TPUSYNC_ASSIGN_OR_RETURN(Frame ch, c.Expect(Op::kChallenge, d, kNonceBytes + 8));
  BodyReader r(ch.body);
  std::span<const std::byte> server_nonce;
  uint64_t block_bytes = 0;
  if (!r.Bytes(kNonceBytes, &server_nonce) || !r.U64(&block_bytes) || !r.done()) return BadFrame("CHALLENGE body");
  TPUSYNC_ASSIGN_OR_RETURN(auto proof, Mac(secret, "tpusync/1 client", server_nonce, client_nonce));
  TPUSYNC_RETURN_IF_ERROR(c.Send(Op::kAuth, proof, d));
  auto ok = c.Expect(Op::kAuthOk, d, kMacBytes);
  if (!ok.ok()) {
    if (ok.status().code() == StatusCode::kUnavailable) {
      return Status(StatusCode::kUnauthenticated, "authentication failed: the peer closed the connection");
    }
    return ok.status();
  }
  TPUSYNC_ASSIGN_OR_RETURN(auto want, Mac(secret, "tpusync/1 server", client_nonce, server_nonce));
  if (!SameMac(ok->body, want)) {
    return Status(StatusCode::kUnauthenticated, "authentication failed: the server does not hold this pool's secret");
  }
  return block_bytes;
}

}  // namespace tpusync::net
