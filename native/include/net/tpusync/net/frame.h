// The tpusync wire protocol, version 3: fixed 32-byte frame headers, then a body; on the data
// port every frame after the handshake is sealed (net/session.h).
// Every field is little-endian. docs/wire-protocol.md is the normative description.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tpusync/block_key.h"
#include "tpusync/status.h"

namespace tpusync::net {

constexpr uint32_t kMagic = 0x59535054;  // "TPSY"
constexpr uint16_t kVersion = 3;  // 3: AEGIS-128X2 sessions (2: AES-256-GCM)
constexpr size_t kHeaderBytes = 32;
constexpr uint64_t kMaxBodyBytes = 64ull << 20;  // metadata bodies; block payloads are bounded by block_bytes
constexpr uint32_t kMaxKeys = 1u << 20;
constexpr uint32_t kMaxChangesWaitMs = 60000;  // a CHANGES long poll waits at most this long
constexpr size_t kNonceBytes = 32;
constexpr size_t kMacBytes = 32;
constexpr size_t kMaxErrorBytes = 4096;  // ERROR and END bodies: a message

enum class Op : uint16_t {
  // handshake
  kHello = 1,      // client -> server: nonce, block_bytes (0: any), flags
  kChallenge = 2,  // server -> client: nonce, block_bytes, flags (the session's)
  kAuth = 3,       // client -> server: HMAC proof of the transcript
  kAuthOk = 4,     // server -> client: HMAC proof of the transcript (mutual)
  // data port
  kExists = 10,      // keys -> kTiers
  kTiers = 11,       // one tier byte per key
  kPull = 12,        // keys -> kTiers, then kBlock per key in order, then kEnd
  kPush = 13,        // keys -> kTiers (wanted: 1, already held: 0), then client sends kBlock..., kEnd
  kPushDone = 14,    // one result byte per key
  kBlock = 15,       // count = key index, body = payload (body_len bytes), status != 0 = absent
  kEnd = 16,
  // control channel (UNIX socket, engines in the same pod)
  kInfo = 30,        // -> kInfoReply: pool path, block_bytes, num_slots
  kInfoReply = 31,
  kLookup = 32,      // status = 1 to pin the prefix; -> kTiers (count = prefix_len in status)
  kPin = 33,         // -> kOk
  kRelease = 34,     // -> kOk
  kReserve = 35,     // keys -> kSlots (per key: result byte, offset, capacity)
  kCommit = 36,      // keys + lengths -> kOk
  kAbort = 37,       // keys -> kOk
  kAcquire = 38,     // keys -> kSlots (per key: result byte, offset, length)
  kUnacquire = 39,   // keys -> kOk
  kEvict = 40,
  kFlush = 41,
  kStats = 42,       // -> kStatsReply (text)
  kStatsReply = 43,
  kSlots = 44,
  kPullFrom = 45,    // peer address + keys -> kTiers (1 = now held locally)
  kPushTo = 46,      // peer address + keys -> kTiers (1 = the peer holds it)
  kExistsAt = 47,    // peer address + keys -> kTiers
  kChanges = 48,     // epoch, seq, wait ms, max keys -> kChangesReply (a long poll: a channel of its own)
  kChangesReply = 49,  // status = 1: changes lost; epoch, seq of the next read, then count keys
  kDescribe = 50,    // keys, then a record (u32 length + bytes) per key -> kOk
  kRecords = 51,     // keys (none: the shared tier's catalog), max keys -> kRecordsReply
  kRecordsReply = 52,  // count keys, then a record per key (empty: none)
  kOk = 60,
  kError = 61,       // status = StatusCode, body = message
};

struct FrameHeader {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  Op op = Op::kOk;
  uint16_t status = 0;  // op-specific small value (an error code, a flag)
  uint16_t reserved = 0;
  uint32_t count = 0;     // keys in the body, or a block's index
  uint64_t body_len = 0;  // bytes after the header
  uint64_t body_sum = 0;  // XXH3-64 of the body; 0 in a sealed session (the tag covers it)
};

// Bytes that break the protocol: kMalformed, which closes the channel (it is out of step).
inline Status BadFrame(const std::string& why) { return Status(StatusCode::kMalformed, "bad frame: " + why); }

void EncodeHeader(const FrameHeader& h, std::byte out[kHeaderBytes]);
// Decodes and validates magic, version, op, reserved and the body bound (`max_body` for
// kBlock frames, kMaxBodyBytes otherwise). Never trusts a field before checking it.
Result<FrameHeader> DecodeHeader(const std::byte in[kHeaderBytes], uint64_t max_block_body);
bool IsKnownOp(uint16_t op);
std::string_view OpName(Op op);

// Bounds-checked little-endian body encoding.
class BodyWriter {
 public:
  void U8(uint8_t v) { buf_.push_back(static_cast<std::byte>(v)); }
  void U32(uint32_t v);
  void U64(uint64_t v);
  void Key(const BlockKey& k) { U64(k.hi), U64(k.lo); }
  void Bytes(std::span<const std::byte> b) { buf_.insert(buf_.end(), b.begin(), b.end()); }
  void Str(std::string_view s);  // u32 length + bytes
  std::vector<std::byte>& bytes() { return buf_; }

 private:
  std::vector<std::byte> buf_;
};

class BodyReader {
 public:
  explicit BodyReader(std::span<const std::byte> b) : b_(b) {}
  // Each returns false (and stays false) once the body is too short.
  bool U8(uint8_t* v);
  bool U32(uint32_t* v);
  bool U64(uint64_t* v);
  bool Key(BlockKey* k) { return U64(&k->hi) && U64(&k->lo); }
  bool Bytes(size_t n, std::span<const std::byte>* out);
  bool Str(std::string* s, size_t max_len);
  bool done() const { return ok_ && pos_ == b_.size(); }

 private:
  std::span<const std::byte> b_;
  size_t pos_ = 0;
  bool ok_ = true;
};

// A key list body: `count` keys and nothing else.
Result<std::vector<BlockKey>> ParseKeyList(std::span<const std::byte> body, uint32_t count);
void WriteKeyList(BodyWriter& w, std::span<const BlockKey> keys);

}  // namespace tpusync::net
