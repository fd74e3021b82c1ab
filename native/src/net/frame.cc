#include "tpusync/net/frame.h"

#include <cstring>

namespace tpusync::net {
namespace {

template <typename T>
void PutLe(std::byte* p, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}

template <typename T>
T GetLe(const std::byte* p) {
  T v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(std::to_integer<uint8_t>(p[i])) << (8 * i);
  return v;
}

}  // namespace

bool IsKnownOp(uint16_t op) {
  return (op >= 1 && op <= 4) || (op >= 10 && op <= 16) || (op >= 30 && op <= 52) || op == 60 || op == 61;
}

std::string_view OpName(Op op) {
  switch (op) {
    case Op::kHello: return "HELLO";
    case Op::kChallenge: return "CHALLENGE";
    case Op::kAuth: return "AUTH";
    case Op::kAuthOk: return "AUTH_OK";
    case Op::kExists: return "EXISTS";
    case Op::kPull: return "PULL";
    case Op::kPush: return "PUSH";
    case Op::kBlock: return "BLOCK";
    case Op::kEnd: return "END";
    case Op::kError: return "ERROR";
    default: return "OP";
  }
}

void EncodeHeader(const FrameHeader& h, std::byte out[kHeaderBytes]) {
  PutLe<uint32_t>(out, h.magic);
  PutLe<uint16_t>(out + 4, h.version);
  PutLe<uint16_t>(out + 6, static_cast<uint16_t>(h.op));
  PutLe<uint16_t>(out + 8, h.status);
  PutLe<uint16_t>(out + 10, h.reserved);
  PutLe<uint32_t>(out + 12, h.count);
  PutLe<uint64_t>(out + 16, h.body_len);
  PutLe<uint64_t>(out + 24, h.body_sum);
}

Result<FrameHeader> DecodeHeader(const std::byte in[kHeaderBytes], uint64_t max_block_body) {
  FrameHeader h;
  h.magic = GetLe<uint32_t>(in);
  if (h.magic != kMagic) return BadFrame("wrong magic");
  h.version = GetLe<uint16_t>(in + 4);
  if (h.version != kVersion) {
    return BadFrame("the peer speaks tpusync wire protocol version " + std::to_string(h.version) +
                    ", this build speaks " + std::to_string(kVersion) +
                    "; run the same tpusync release on every member of the pool");
  }
  uint16_t op = GetLe<uint16_t>(in + 6);
  if (!IsKnownOp(op)) return BadFrame("unknown op " + std::to_string(op));
  h.op = static_cast<Op>(op);
  h.status = GetLe<uint16_t>(in + 8);
  h.reserved = GetLe<uint16_t>(in + 10);
  if (h.reserved != 0) return BadFrame("reserved field is not zero");
  h.count = GetLe<uint32_t>(in + 12);
  h.body_len = GetLe<uint64_t>(in + 16);
  h.body_sum = GetLe<uint64_t>(in + 24);
  const uint64_t limit = h.op == Op::kBlock ? max_block_body : kMaxBodyBytes;
  if (h.body_len > limit) {
    return BadFrame(std::string(OpName(h.op)) + " body of " + std::to_string(h.body_len) +
                    " bytes exceeds " + std::to_string(limit));
  }
  if (h.op != Op::kBlock && h.count > kMaxKeys) {
    return BadFrame(std::to_string(h.count) + " keys exceed " + std::to_string(kMaxKeys));
  }
  return h;
}

void BodyWriter::U32(uint32_t v) {
  std::byte b[4];
  PutLe(b, v);
  buf_.insert(buf_.end(), b, b + 4);
}

void BodyWriter::U64(uint64_t v) {
  std::byte b[8];
  PutLe(b, v);
  buf_.insert(buf_.end(), b, b + 8);
}

void BodyWriter::Str(std::string_view s) {
  U32(static_cast<uint32_t>(s.size()));
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  buf_.insert(buf_.end(), p, p + s.size());
}

bool BodyReader::Bytes(size_t n, std::span<const std::byte>* out) {
  if (!ok_ || b_.size() - pos_ < n) return ok_ = false;
  *out = b_.subspan(pos_, n);
  pos_ += n;
  return true;
}

bool BodyReader::U8(uint8_t* v) {
  std::span<const std::byte> b;
  if (!Bytes(1, &b)) return false;
  *v = std::to_integer<uint8_t>(b[0]);
  return true;
}

bool BodyReader::U32(uint32_t* v) {
  std::span<const std::byte> b;
  if (!Bytes(4, &b)) return false;
  *v = GetLe<uint32_t>(b.data());
  return true;
}

bool BodyReader::U64(uint64_t* v) {
  std::span<const std::byte> b;
  if (!Bytes(8, &b)) return false;
  *v = GetLe<uint64_t>(b.data());
  return true;
}

bool BodyReader::Str(std::string* s, size_t max_len) {
  uint32_t n = 0;
  std::span<const std::byte> b;
  if (!U32(&n) || n > max_len || !Bytes(n, &b)) return ok_ = false;
  s->assign(reinterpret_cast<const char*>(b.data()), b.size());
  return true;
}

Result<std::vector<BlockKey>> ParseKeyList(std::span<const std::byte> body, uint32_t count) {
  if (body.size() != uint64_t{count} * 16) {
    return BadFrame(std::to_string(count) + " keys need " + std::to_string(count * 16ull) +
                    " body bytes, got " + std::to_string(body.size()));
  }
  std::vector<BlockKey> keys(count);
  BodyReader r(body);
  for (auto& k : keys) r.Key(&k);
  return keys;
}

void WriteKeyList(BodyWriter& w, std::span<const BlockKey> keys) {
  for (const auto& k : keys) w.Key(k);
}

}  // namespace tpusync::net
