/*
 * Stacks without frame pointers: built -O2 -fomit-frame-pointer -g. main calls
 * chain_one -> chain_two -> chain_three -> chain_four -> malloc (all noinline; each
 * uses the result afterwards, so none is a tail call), and chain_two reaches
 * chain_three through inlined_step, which is always inlined into it.
 *
 * Protocol as sites.c: prints its pid, waits for a line on stdin, runs, exits. With
 * the argument "short" it only allocates for about 50 ms after the line, then exits (a
 * short-lived process).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void *volatile sink;
static volatile long checksum;

__attribute__((noinline)) char *chain_four(size_t size) {
    char *p = malloc(size);
    if (p) p[0] = 1;
    return p;
}

__attribute__((noinline)) char *chain_three(size_t size) {
    char *p = chain_four(size);
    checksum += (long)size;
    return p;
}

static inline __attribute__((always_inline)) char *inlined_step(size_t size) {
    char *p = chain_three(size);
    checksum ^= 3;
    return p;
}

__attribute__((noinline)) char *chain_two(size_t size) {
    char *p = inlined_step(size);
    checksum += 2;
    return p;
}

__attribute__((noinline)) void chain_one(long rounds) {
    for (long i = 0; i < rounds; i++) {
        char *p = chain_two(4096);
        sink = p;
        free(p);
        checksum += 1;
    }
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    char buf[16];
    printf("%d\n", getpid());
    fflush(stdout);
    if (read(0, buf, sizeof buf) <= 0) return 1;
    if (argc > 1 && strcmp(argv[1], "short") == 0) {
        double start = now();
        while (now() - start < 0.05) chain_one(100);
        return 0;
    }
    chain_one(20000);
    return 0;
}
