/*
 * A hostile process, for the agent's tests: it replaces the path of its own executable
 * with something an agent must never open by path, then allocates until killed.
 *
 * Usage: swapexe fifo|zero|libc   Prints its pid, then "swapped" once the path of its
 * executable (from /proc/self/exe) is a FIFO, a symlink to /dev/zero, or a symlink to
 * the C library it runs on. An agent that opens the path instead of the mapping hangs
 * in open() (FIFO), reads without end (/dev/zero), or examines (and would probe) libc
 * in place of this file.
 */
#define _GNU_SOURCE
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static void *volatile sink;

/* The path of the C library this process maps. */
static int find_libc(struct dl_phdr_info *info, size_t size, void *out) {
    (void)size;
    if (strstr(info->dlpi_name, "libc.so")) {
        strncpy(out, info->dlpi_name, 4095);
        return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: swapexe fifo|zero|libc\n");
        return 2;
    }
    printf("%d\n", getpid());
    fflush(stdout);
    char exe[4096] = {0};
    if (readlink("/proc/self/exe", exe, sizeof exe - 1) <= 0 || unlink(exe) != 0) {
        perror("swapexe: unlink own executable");
        return 1;
    }
    int failed;
    if (!strcmp(argv[1], "fifo")) {
        failed = mkfifo(exe, 0600);
    } else if (!strcmp(argv[1], "zero")) {
        failed = symlink("/dev/zero", exe);
    } else {
        char libc[4096] = {0};
        dl_iterate_phdr(find_libc, libc);
        failed = !libc[0] || symlink(libc, exe);
    }
    if (failed) {
        perror("swapexe: replace own executable");
        return 1;
    }
    printf("swapped\n");
    fflush(stdout);
    /* ~400 KB per ms: about 800 samples a second at the default rate. */
    struct timespec pause = {0, 1000000};
    for (;;) {
        for (int i = 0; i < 100; i++) {
            sink = malloc(4096);
            free(sink);
        }
        nanosleep(&pause, NULL);
    }
}
