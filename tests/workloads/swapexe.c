/*
 * A hostile process, for the agent's tests: it replaces the path of its own executable
 * with something an agent must never open by path, then allocates until killed.
 *
 * Usage: swapexe fifo|zero|libc   Prints its pid, then "swapped" once the path of its
 * executable (from /proc/self/exe) is a FIFO, a symlink to /dev/zero, or a symlink to
 * the C library it runs on. An agent that opens the path instead of the mapping hangs
 * in open() (FIFO), reads without end (/dev/zero), or examines (and would probe) libc
 * in place of this file.
 *
 * Built with -DOWN_MALLOC, it is an allocator itself (malloc and free of its own, which
 * the C library's calls reach too), and `swapexe race` keeps swapping its path between
 * itself and a symlink to the C library, every millisecond, for as long as it runs: an
 * agent that reads one file and attaches by path, between discovery and attach, plants
 * this file's probe offsets in the host's libc (and this process is never sampled).
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

#ifdef OWN_MALLOC
/* Blocks of up to 4 KiB take a 4 KiB slot, so the last one freed can serve any small
 * request; larger ones are never reused. Single-threaded, like this program. */
static char arena[64 << 20];
static size_t used;
static void *last_freed;

void *malloc(size_t n) {
    if (n <= 4096 && last_freed) {
        void *p = last_freed;
        last_freed = NULL;
        return p;
    }
    size_t take = n <= 4096 ? 4096 : (n + 4095) & ~(size_t)4095;
    if (used + take > sizeof arena) {
        return NULL;
    }
    void *p = arena + used;
    used += take;
    return p;
}

void free(void *p) {
    if (p) {
        last_freed = p;
    }
}

void *calloc(size_t count, size_t size) {
    void *p = malloc(count * size);
    if (p) {
        memset(p, 0, count * size);
    }
    return p;
}

void *realloc(void *old, size_t n) {
    void *p = malloc(n);
    if (p && old) {
        size_t room = (size_t)(arena + sizeof arena - (char *)old);
        memcpy(p, old, n < room ? n : room);
    }
    return p;
}
#endif

/* Renames a fresh symlink to `target`, or a fresh hard link of `file`, over `path`. */
static int put_symlink(const char *target, const char *path) {
    char temp[4200];
    snprintf(temp, sizeof temp, "%s.s", path);
    unlink(temp);
    return symlink(target, temp) || rename(temp, path);
}

static int put_link(const char *file, const char *path) {
    char temp[4200];
    snprintf(temp, sizeof temp, "%s.l", path);
    unlink(temp);
    return link(file, temp) || rename(temp, path);
}

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
        fprintf(stderr, "usage: swapexe fifo|zero|libc|race\n");
        return 2;
    }
    printf("%d\n", getpid());
    fflush(stdout);
    char exe[4096] = {0};
    char libc[4096] = {0};
    dl_iterate_phdr(find_libc, libc);
    if (!strcmp(argv[1], "race")) {
        /* The file itself stays reachable under a second name. */
        char keep[4200];
        if (readlink("/proc/self/exe", exe, sizeof exe - 1) <= 0 || !libc[0]) {
            return 1;
        }
        snprintf(keep, sizeof keep, "%s.real", exe);
        unlink(keep);
        if (link(exe, keep)) {
            perror("swapexe: link");
            return 1;
        }
        printf("swapped\n");
        fflush(stdout);
        struct timespec pause = {0, 1000000};
        for (int round = 0;; round++) {
            for (int i = 0; i < 100; i++) {
                sink = malloc(4096);
                free(sink);
            }
            if (round % 2 ? put_link(keep, exe) : put_symlink(libc, exe)) {
                perror("swapexe: swap");
                return 1;
            }
            nanosleep(&pause, NULL);
        }
    }
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
