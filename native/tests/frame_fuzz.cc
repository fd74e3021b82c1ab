// libFuzzer target: arbitrary bytes fed to the frame decoder, the body readers, and a live
// FramedConn over a socket pair, as a peer could send them. Must never crash or leak.
#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "net/conn.h"
#include "tpusync/net/frame.h"

using namespace tpusync;
using namespace tpusync::net;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto* bytes = reinterpret_cast<const std::byte*>(data);
  if (size >= kHeaderBytes) {
    auto h = DecodeHeader(bytes, 1 << 16);
    if (h.ok() && h->op != Op::kBlock) {
      auto body = std::span(bytes + kHeaderBytes, size - kHeaderBytes);
      (void)ParseKeyList(body, h->count);
      BodyReader r(body);
      std::string s;
      uint64_t v;
      while (r.Str(&s, 512) && r.U64(&v)) {
      }
    }
  }
  // The same bytes arriving on a connection, capped so the socket buffer never blocks.
  if (size > 0 && size < 100000) {
    int fds[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, fds) != 0) return 0;
    Socket a{UniqueFd(fds[0])}, b{UniqueFd(fds[1])};
    (void)a.WriteFull(data, size, Deadline::After(std::chrono::milliseconds(100)));
    a.Close();
    FramedConn c(b, 1 << 16);
    // Half the inputs meet a sealed session (fixed keys: the fuzzer can reach the payload and
    // tag paths, never forge a tag), half a plain one (which refuses every BLOCK).
    if (size % 2 == 1) c.Seal(std::make_unique<SessionCipher>(SessionKey{}, SessionKey{}, (data[0] & 1) != 0));
    auto d = Deadline::After(std::chrono::milliseconds(100));
    for (int i = 0; i < 8; ++i) {
      auto h = c.RecvBlockHeader(d);
      if (!h.ok()) break;
      if (h->op == Op::kBlock && h->status == 0) {
        std::vector<std::byte> dst(h->body_len);
        if (!c.RecvBlockPayload(dst.data(), h->body_len, d).ok()) break;
      }
    }
  }
  return 0;
}
