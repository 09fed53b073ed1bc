/* Minimal pod sandbox "pause" process for the Sandman local cluster.
 * Holds the pod's namespaces open, reaps zombies (it is PID 1 of the pod
 * when the PID namespace is shared) and exits cleanly on SIGINT/SIGTERM. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig) { (void)sig; _exit(0); }
static void on_chld(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {}
}

int main(int argc, char **argv) {
  if (argc > 1 && argv[1][0] == '-' && argv[1][1] == 'v') { puts("sandman-pause 1"); return 0; }
  if (getpid() != 1) fprintf(stderr, "sandman-pause: warning: not PID 1\n");
  struct sigaction sa = {0};
  sa.sa_handler = on_term;
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  sa.sa_handler = on_chld;
  sa.sa_flags = SA_NOCLDSTOP;
  sigaction(SIGCHLD, &sa, NULL);
  for (;;) pause();
  return 1;
}
