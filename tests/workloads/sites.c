/*
 * Known allocation sites with known byte totals, for allocbpf's end-to-end tests.
 *
 * Prints its pid, waits for a line on stdin (so the profiler attaches first), runs
 * every site, prints "done" and exits (with the argument "forever": runs them until
 * killed). It uses write(2), never stdio, so that the
 * process makes no allocation of its own while profiled: the exact totals allocbpf
 * counts must equal the sums in tests/src/sites.rs to the byte.
 *
 * Built with frame pointers (-fno-omit-frame-pointer) and noinline sites, so that
 * stacks read "site_x < run_sites < main".
 */
#define _GNU_SOURCE
#include <malloc.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NOINLINE __attribute__((noinline))

/* Keeps the compiler from eliding allocations. */
static void *volatile sink;

static void say(const char *s) { (void)!write(1, s, strlen(s)); }

/* 100,000 x 1 KiB through malloc. */
NOINLINE void site_small(void) {
    for (int i = 0; i < 100000; i++) { sink = malloc(1024); free(sink); }
}

/* 16 x 4 MiB through malloc: above the certain threshold at 64 KiB. */
NOINLINE void site_large(void) {
    for (int i = 0; i < 16; i++) { sink = malloc(4 << 20); free(sink); }
}

/* 20,000 x calloc(16, 64) = 1 KiB each. */
NOINLINE void site_calloc(void) {
    for (int i = 0; i < 20000; i++) { sink = calloc(16, 64); free(sink); }
}

/* 10,000 chains: realloc(NULL, 512) (glibc forwards it to malloc: counted once),
 * then realloc to 2048 and to 8192 bytes: 10,752 bytes in 3 calls per chain. */
NOINLINE void site_realloc(void) {
    for (int i = 0; i < 10000; i++) {
        void *p = realloc(NULL, 512);
        p = realloc(p, 2048);
        p = realloc(p, 8192);
        sink = p;
        free(p);
    }
}

/* 10,000 x reallocarray(NULL, 100, 16) = 1,600 bytes (glibc forwards to realloc,
 * which forwards to malloc: counted once). */
NOINLINE void site_reallocarray(void) {
    for (int i = 0; i < 10000; i++) { sink = reallocarray(NULL, 100, 16); free(sink); }
}

/* 10,000 x posix_memalign(64, 2048) and 5,000 x aligned_alloc(4096, 8192). */
NOINLINE void site_aligned(void) {
    for (int i = 0; i < 10000; i++) {
        void *p;
        if (posix_memalign(&p, 64, 2048) == 0) { sink = p; free(p); }
    }
    for (int i = 0; i < 5000; i++) { sink = aligned_alloc(4096, 8192); free(sink); }
}

/* One calloc whose size overflows: a call that allocates nothing (0 bytes). The
 * count is volatile so the compiler neither warns nor folds the call away. */
static volatile size_t huge_count = SIZE_MAX / 2;
NOINLINE void site_overflow(void) {
    sink = calloc(huge_count, 4);
}

NOINLINE void run_sites(void) {
    site_small();
    site_large();
    site_calloc();
    site_realloc();
    site_reallocarray();
    site_aligned();
    site_overflow();
}

int main(int argc, char **argv) {
    char buf[64];
    char line[32];
    int n = 0;
    pid_t pid = getpid();
    /* itoa without stdio */
    char digits[16];
    int d = 0;
    do { digits[d++] = '0' + pid % 10; pid /= 10; } while (pid);
    while (d) line[n++] = digits[--d];
    line[n++] = '\n';
    (void)!write(1, line, n);
    if (read(0, buf, sizeof buf) <= 0) return 1;
    /* "forever": allocate until killed (for stop-by-signal tests). */
    do run_sites(); while (argc > 1 && strcmp(argv[1], "forever") == 0);
    say("done\n");
    return 0;
}
