// rawtcp: the raw TCP baseline for the transfer benchmarks, N streams as fast as the kernel allows.
//
//   rawtcp recv BIND_IP STREAMS BYTES REPS   prints "port P", then one JSON line per rep
//   rawtcp send HOST:PORT STREAMS BYTES REPS  prints one JSON line per rep
//
// The receiver accepts STREAMS connections; each rep it sends one byte on every stream
// ("go"), the sender's thread for that stream writes its BYTES/STREAMS share from a
// pre-faulted buffer (write() of up to 4 MiB), and the receiver's thread reads it into its
// own part of a pre-faulted BYTES buffer (recv() of up to 4 MiB), as a sidecar lands blocks
// in its pool. The receiver's time per rep runs from "go" to the last byte. Both sides print
// the CPU seconds (user + system, all threads) they spent in the rep, so a benchmark can add
// them up. Built by bench/rawtcp.py: g++ -O2 -pthread.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr size_t kIo = 4 << 20;

[[noreturn]] void Die(const char* what) {
  std::perror(what);
  std::exit(1);
}

double CpuSeconds() {
  rusage r{};
  getrusage(RUSAGE_SELF, &r);
  return r.ru_utime.tv_sec + r.ru_stime.tv_sec + (r.ru_utime.tv_usec + r.ru_stime.tv_usec) / 1e6;
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void ReadExact(int fd, char* p, size_t n) {
  while (n) {
    ssize_t got = ::recv(fd, p, n < kIo ? n : kIo, 0);
    if (got <= 0) Die("recv");
    p += got;
    n -= static_cast<size_t>(got);
  }
}

void WriteExact(int fd, const char* p, size_t n) {
  while (n) {
    ssize_t put = ::send(fd, p, n < kIo ? n : kIo, MSG_NOSIGNAL);
    if (put <= 0) Die("send");
    p += put;
    n -= static_cast<size_t>(put);
  }
}

std::vector<char> Prefaulted(size_t n, char fill) {
  std::vector<char> buf(n);
  std::memset(buf.data(), fill, n);  // every page touched before timing starts
  return buf;
}

// Runs fn(i) on one thread per stream and waits for all.
template <typename Fn>
void PerStream(int streams, Fn fn) {
  std::vector<std::thread> threads;
  for (int i = 0; i < streams; ++i) threads.emplace_back(fn, i);
  for (auto& t : threads) t.join();
}

int Recv(const char* bind_ip, int streams, size_t bytes, int reps) {
  int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (lfd < 0) Die("socket");
  int one = 1;
  ::setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (::inet_pton(AF_INET, bind_ip, &addr.sin_addr) != 1) Die("inet_pton");
  if (::bind(lfd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) < 0) Die("bind");
  if (::listen(lfd, streams) < 0) Die("listen");
  socklen_t len = sizeof(addr);
  ::getsockname(lfd, reinterpret_cast<sockaddr*>(&addr), &len);
  std::printf("port %d\n", ntohs(addr.sin_port));
  std::fflush(stdout);
  std::vector<int> fds;
  for (int i = 0; i < streams; ++i) {
    int fd = ::accept(lfd, nullptr, nullptr);
    if (fd < 0) Die("accept");
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    fds.push_back(fd);
  }
  std::vector<char> sink = Prefaulted(bytes, 0);
  size_t share = bytes / static_cast<size_t>(streams);
  for (int r = 0; r < reps; ++r) {
    double cpu0 = CpuSeconds(), t0 = Now();
    PerStream(streams, [&](int i) {
      char go = 'g';
      WriteExact(fds[i], &go, 1);
      size_t n = i == streams - 1 ? bytes - share * (streams - 1) : share;
      ReadExact(fds[i], sink.data() + share * static_cast<size_t>(i), n);
    });
    double seconds = Now() - t0, cpu = CpuSeconds() - cpu0;
    std::printf("{\"rep\": %d, \"seconds\": %.9f, \"cpu_seconds\": %.6f}\n", r, seconds, cpu);
    std::fflush(stdout);
  }
  for (int fd : fds) ::close(fd);
  ::close(lfd);
  return 0;
}

int Send(const std::string& target, int streams, size_t bytes, int reps) {
  size_t colon = target.rfind(':');
  if (colon == std::string::npos) Die("HOST:PORT");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::atoi(target.c_str() + colon + 1)));
  if (::inet_pton(AF_INET, target.substr(0, colon).c_str(), &addr.sin_addr) != 1) Die("inet_pton");
  std::vector<int> fds;
  int one = 1;
  for (int i = 0; i < streams; ++i) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) Die("socket");
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) < 0) Die("connect");
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    fds.push_back(fd);
  }
  std::vector<char> src = Prefaulted(bytes, 1);
  size_t share = bytes / static_cast<size_t>(streams);
  for (int r = 0; r < reps; ++r) {
    double cpu0 = CpuSeconds();
    PerStream(streams, [&](int i) {
      char go;
      ReadExact(fds[i], &go, 1);
      size_t n = i == streams - 1 ? bytes - share * (streams - 1) : share;
      WriteExact(fds[i], src.data() + share * static_cast<size_t>(i), n);
    });
    std::printf("{\"rep\": %d, \"cpu_seconds\": %.6f}\n", r, CpuSeconds() - cpu0);
    std::fflush(stdout);
  }
  for (int fd : fds) ::close(fd);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s recv BIND_IP STREAMS BYTES REPS | send HOST:PORT STREAMS BYTES REPS\n", argv[0]);
    return 2;
  }
  std::string mode = argv[1];
  int streams = std::atoi(argv[3]);
  size_t bytes = std::strtoull(argv[4], nullptr, 10);
  int reps = std::atoi(argv[5]);
  if (streams < 1 || bytes < static_cast<size_t>(streams) || reps < 1) {
    std::fprintf(stderr, "need STREAMS >= 1, BYTES >= STREAMS, REPS >= 1\n");
    return 2;
  }
  if (mode == "recv") return Recv(argv[2], streams, bytes, reps);
  if (mode == "send") return Send(argv[2], streams, bytes, reps);
  std::fprintf(stderr, "mode must be recv or send\n");
  return 2;
}
