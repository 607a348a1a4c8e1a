/* The sandbox ("pause") container of the test cluster's pods: it holds
 * the pod's namespaces, reaps what is reparented to it, and exits on
 * SIGINT or SIGTERM. Built static by tests/cluster.sh into an image of
 * its own (FROM scratch), so no registry is needed. Our own code. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) {
  (void)sig;
  _exit(0);
}

static void on_child(int sig) {
  (void)sig;
  while (waitpid(-1, 0, WNOHANG) > 0) {
  }
}

int main(void) {
  signal(SIGINT, on_stop);
  signal(SIGTERM, on_stop);
  signal(SIGCHLD, on_child);
  for (;;) pause();
}
