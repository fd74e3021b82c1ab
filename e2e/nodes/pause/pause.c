/* The pod sandbox's process for the real-node tier (harness/nodes.py): holds the pod's
 * namespaces, reaps the zombies it inherits as PID 1, and exits on SIGINT or SIGTERM.
 * registry.k8s.io/pause does this job on a real node; that registry is not reachable here,
 * so the node's runtime is given this program as its sandbox image instead. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) { (void)sig; _exit(0); }

static void on_child(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction stop = {.sa_handler = on_stop};
  struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP};
  if (sigaction(SIGINT, &stop, NULL) < 0 || sigaction(SIGTERM, &stop, NULL) < 0 ||
      sigaction(SIGCHLD, &child, NULL) < 0) {
    return 1;
  }
  for (;;) pause();
}
