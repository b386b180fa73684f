/*
 * Process churn, for the agent's tests: forks N children, each of which calls malloc
 * and free a few times (too little to be sampled) and exits at once, like the cron jobs
 * and scripts of a real host. Each leaves kernel entries behind it (its exact totals,
 * its gate) that only the agent can remove.
 *
 * Usage: churn N   Prints "done" once every child has been reaped.
 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void *volatile sink;

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: churn N\n");
        return 2;
    }
    int n = atoi(argv[1]);
    for (int i = 0; i < n; i++) {
        pid_t child = fork();
        if (child == 0) {
            for (int j = 0; j < 10; j++) {
                sink = malloc(64);
                free(sink);
            }
            _exit(0);
        }
        if (child < 0) {
            perror("fork");
            return 1;
        }
        /* At most ~64 children at once. */
        if (i % 64 == 63) {
            while (waitpid(-1, NULL, 0) > 0) {
            }
        }
    }
    while (wait(NULL) > 0) {
    }
    printf("done\n");
    fflush(stdout);
    return 0;
}
