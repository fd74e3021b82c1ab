/* fabric-delay: a one-way propagation delay and packet loss for one simulated host's NIC.
 *
 * This kernel has no netem qdisc, so the fabric harness (harness/fabric.py) sends every
 * packet a host puts on its NIC through NFQUEUE (an iptables OUTPUT rule in the host's network
 * namespace) to this program, which runs in that namespace. It receives only the packet's
 * metadata (NFQNL_COPY_META: no payload is copied to user space, GSO packets stay whole) and
 * hands the verdict back `delay` microseconds after the packet arrived, in arrival order, with
 * one batch verdict for every packet that is due. `loss` percent of the packets are dropped
 * (100 = the link is down). The packet then goes on to the NIC's qdisc, which shapes the rate.
 *
 *     fabric-delay QUEUE DELAY_US [LOSS_PERCENT]
 *
 * Prints "ready" once bound. Commands on stdin, one per line, each answered with "ok":
 * "delay US", "loss PERCENT", "stats" (answers "stats <seen> <dropped> <accepted>").
 * Exits when stdin closes, so it dies with the harness that started it.
 */
#define _GNU_SOURCE
#include <arpa/inet.h> /* before the linux/ headers, which would redefine in_addr */
#include <errno.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netfilter/nfnetlink_queue.h>
#include <linux/netlink.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_HELD (1 << 16) /* packets held at once; the queue's kernel limit is the same */

struct held { uint32_t id; int64_t due_ns; };

static struct held ring[MAX_HELD];
static unsigned head, count;
static int64_t delay_ns;
static uint32_t loss_ppm;           /* drop probability in parts per million */
static uint64_t seen, dropped, accepted;
static uint64_t rng = 0x9e3779b97f4a7c15ull;

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static uint32_t rand_ppm(void) { /* xorshift64: cheap and good enough for a loss rate */
  rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
  return (uint32_t)(rng % 1000000);
}

static void die(const char *what) { perror(what); exit(1); }

/* Appends one attribute to the message in buf. */
static void put_attr(struct nlmsghdr *nlh, uint16_t type, const void *data, uint16_t len) {
  struct nlattr *a = (struct nlattr *)((char *)nlh + NLMSG_ALIGN(nlh->nlmsg_len));
  a->nla_type = type;
  a->nla_len = NLA_HDRLEN + len;
  memcpy((char *)a + NLA_HDRLEN, data, len);
  nlh->nlmsg_len = NLMSG_ALIGN(nlh->nlmsg_len) + NLA_ALIGN(a->nla_len);
}

static struct nlmsghdr *start_msg(char *buf, uint8_t type, uint16_t queue, uint16_t flags) {
  memset(buf, 0, 256);
  struct nlmsghdr *nlh = (struct nlmsghdr *)buf;
  nlh->nlmsg_len = NLMSG_LENGTH(sizeof(struct nfgenmsg));
  nlh->nlmsg_type = (NFNL_SUBSYS_QUEUE << 8) | type;
  nlh->nlmsg_flags = NLM_F_REQUEST | flags;
  struct nfgenmsg *g = NLMSG_DATA(nlh);
  g->nfgen_family = AF_UNSPEC;
  g->version = NFNETLINK_V0;
  g->res_id = htons(queue);
  return nlh;
}

static void send_msg(int fd, struct nlmsghdr *nlh) {
  struct sockaddr_nl to = {.nl_family = AF_NETLINK};
  if (sendto(fd, nlh, nlh->nlmsg_len, 0, (struct sockaddr *)&to, sizeof(to)) < 0) die("sendto netlink");
}

/* Sends a config message and waits for the kernel's ack, so a failed bind is reported. */
static void config(int fd, struct nlmsghdr *nlh) {
  nlh->nlmsg_flags |= NLM_F_ACK;
  send_msg(fd, nlh);
  char buf[4096];
  ssize_t n = recv(fd, buf, sizeof(buf), 0);
  if (n < 0) die("recv ack");
  struct nlmsghdr *r = (struct nlmsghdr *)buf;
  if (r->nlmsg_type == NLMSG_ERROR) {
    int err = ((struct nlmsgerr *)NLMSG_DATA(r))->error;
    if (err) { errno = -err; die("nfqueue config"); }
  }
}

static void verdict(int fd, uint16_t queue, uint8_t type, uint32_t id, uint32_t v) {
  char buf[256];
  struct nlmsghdr *nlh = start_msg(buf, type, queue, 0);
  struct nfqnl_msg_verdict_hdr vh = {.verdict = htonl(v), .id = htonl(id)};
  put_attr(nlh, NFQA_VERDICT_HDR, &vh, sizeof(vh));
  send_msg(fd, nlh);
}

/* Accepts, with one batch verdict, every held packet whose time has come. */
static void release_due(int fd, uint16_t queue) {
  int64_t t = now_ns();
  uint32_t last = 0;
  unsigned n = 0;
  while (count && ring[head].due_ns <= t) {
    last = ring[head].id;
    head = (head + 1) % MAX_HELD;
    count--;
    n++;
  }
  if (n) {
    verdict(fd, queue, NFQNL_MSG_VERDICT_BATCH, last, NF_ACCEPT);
    accepted += n;
  }
}

static void on_packets(int fd, uint16_t queue, char *buf, ssize_t len) {
  int64_t t = now_ns();
  for (struct nlmsghdr *nlh = (struct nlmsghdr *)buf; NLMSG_OK(nlh, len); nlh = NLMSG_NEXT(nlh, len)) {
    if ((nlh->nlmsg_type & 0xff) != NFQNL_MSG_PACKET) continue;
    struct nlattr *a = (struct nlattr *)((char *)NLMSG_DATA(nlh) + NLMSG_ALIGN(sizeof(struct nfgenmsg)));
    int left = nlh->nlmsg_len - NLMSG_LENGTH(NLMSG_ALIGN(sizeof(struct nfgenmsg)));
    while (left >= NLA_HDRLEN && a->nla_len >= NLA_HDRLEN && a->nla_len <= left) {
      if ((a->nla_type & NLA_TYPE_MASK) == NFQA_PACKET_HDR) {
        struct nfqnl_msg_packet_hdr *ph = (struct nfqnl_msg_packet_hdr *)((char *)a + NLA_HDRLEN);
        uint32_t id = ntohl(ph->packet_id);
        seen++;
        if (loss_ppm && (loss_ppm >= 1000000 || rand_ppm() < loss_ppm)) {
          verdict(fd, queue, NFQNL_MSG_VERDICT, id, NF_DROP);
          dropped++;
        } else if (count == MAX_HELD) { /* cannot happen with the kernel queue at MAX_HELD */
          verdict(fd, queue, NFQNL_MSG_VERDICT, id, NF_DROP);
          dropped++;
        } else {
          ring[(head + count) % MAX_HELD] = (struct held){id, t + delay_ns};
          count++;
        }
        break;
      }
      left -= NLA_ALIGN(a->nla_len);
      a = (struct nlattr *)((char *)a + NLA_ALIGN(a->nla_len));
    }
  }
}

static int on_command(void) {
  static char line[256];
  static size_t used;
  ssize_t n = read(0, line + used, sizeof(line) - 1 - used);
  if (n <= 0) return 0;
  used += (size_t)n;
  line[used] = 0;
  char *nl;
  while ((nl = strchr(line, '\n')) != NULL) {
    *nl = 0;
    double v;
    if (sscanf(line, "delay %lf", &v) == 1) {
      delay_ns = (int64_t)(v * 1000);
      printf("ok\n");
    } else if (sscanf(line, "loss %lf", &v) == 1) {
      loss_ppm = (uint32_t)(v * 10000);
      printf("ok\n");
    } else if (strcmp(line, "stats") == 0) {
      printf("stats %llu %llu %llu\n", (unsigned long long)seen, (unsigned long long)dropped,
             (unsigned long long)accepted);
    } else {
      printf("error: unknown command %s\n", line);
    }
    fflush(stdout);
    size_t rest = used - (size_t)(nl + 1 - line);
    memmove(line, nl + 1, rest + 1);
    used = rest;
  }
  if (used == sizeof(line) - 1) used = 0; /* an over-long line: drop it */
  return 1;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s QUEUE DELAY_US [LOSS_PERCENT]\n", argv[0]);
    return 2;
  }
  uint16_t queue = (uint16_t)atoi(argv[1]);
  delay_ns = (int64_t)(atof(argv[2]) * 1000);
  loss_ppm = argc > 3 ? (uint32_t)(atof(argv[3]) * 10000) : 0;
  rng ^= (uint64_t)getpid() << 20;
  prctl(PR_SET_TIMERSLACK, 1UL); /* wake-ups within microseconds, not the default 50 us */

  int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_NETFILTER);
  if (fd < 0) die("socket netlink");
  int rcvbuf = 16 << 20; /* bursts of packet messages must not overflow (ENOBUFS) */
  setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &rcvbuf, sizeof(rcvbuf));
  struct sockaddr_nl me = {.nl_family = AF_NETLINK};
  if (bind(fd, (struct sockaddr *)&me, sizeof(me)) < 0) die("bind netlink");
  int one = 1; /* no ENOBUFS reports: the kernel drops what it cannot queue, as a full NIC would */
  setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof(one));

  char buf[256];
  struct nlmsghdr *nlh = start_msg(buf, NFQNL_MSG_CONFIG, queue, 0);
  struct nfqnl_msg_config_cmd cmd = {.command = NFQNL_CFG_CMD_BIND};
  put_attr(nlh, NFQA_CFG_CMD, &cmd, sizeof(cmd));
  config(fd, nlh);
  nlh = start_msg(buf, NFQNL_MSG_CONFIG, queue, 0);
  struct nfqnl_msg_config_params params = {.copy_range = htonl(0), .copy_mode = NFQNL_COPY_META};
  put_attr(nlh, NFQA_CFG_PARAMS, &params, sizeof(params));
  uint32_t maxlen = htonl(MAX_HELD);
  put_attr(nlh, NFQA_CFG_QUEUE_MAXLEN, &maxlen, sizeof(maxlen));
  uint32_t flags = htonl(NFQA_CFG_F_GSO), mask = htonl(NFQA_CFG_F_GSO); /* GSO packets stay whole */
  put_attr(nlh, NFQA_CFG_FLAGS, &flags, sizeof(flags));
  put_attr(nlh, NFQA_CFG_MASK, &mask, sizeof(mask));
  config(fd, nlh);
  printf("ready\n");
  fflush(stdout);

  static char rx[1 << 16];
  for (;;) {
    struct pollfd fds[2] = {{.fd = fd, .events = POLLIN}, {.fd = 0, .events = POLLIN}};
    struct timespec wait, *timeout = NULL;
    if (count) {
      int64_t d = ring[head].due_ns - now_ns();
      if (d < 0) d = 0;
      wait.tv_sec = d / 1000000000;
      wait.tv_nsec = d % 1000000000;
      timeout = &wait;
    }
    if (ppoll(fds, 2, timeout, NULL) < 0 && errno != EINTR) die("ppoll");
    if (fds[0].revents & POLLIN) {
      ssize_t n;
      while ((n = recv(fd, rx, sizeof(rx), MSG_DONTWAIT)) > 0) on_packets(fd, queue, rx, n);
      if (n < 0 && errno != EAGAIN && errno != ENOBUFS) die("recv netlink");
    }
    if ((fds[1].revents & (POLLIN | POLLHUP)) && !on_command()) return 0;
    release_due(fd, queue);
  }
}
