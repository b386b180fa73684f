/*
 * A CPU-bound allocator with a known byte total, for the observer-effect tests: CALLS
 * (argv[1]) times, busy_alloc_site computes WORK (argv[3]) steps of a multiply-add
 * chain (its own work, ~1 ns a step) and allocates and frees SIZE (argv[2]) bytes.
 * It never sleeps, so time in probe traps is time taken from its work: it is slowed
 * while probed, unlike steady.c, which is paced by the clock. With "wait" (argv[4]) it
 * waits for a line on stdin first. Prints its pid first and, at the end, "allocated
 * CALLS BYTES": the truth the profiler's estimate is compared with.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

__attribute__((noinline)) unsigned long busy_alloc_site(size_t size, long work, unsigned long x) {
    for (long i = 0; i < work; i++)
        x = x * 6364136223846793005UL + 1442695040888963407UL;
    char *volatile p = malloc(size);
    p[0] = (char)x;
    free(p);
    return x;
}

int main(int argc, char **argv) {
    long calls = argc > 1 ? atol(argv[1]) : 1000000;
    size_t size = argc > 2 ? strtoul(argv[2], NULL, 10) : 4096;
    long work = argc > 3 ? atol(argv[3]) : 1000;
    printf("%d\n", getpid());
    fflush(stdout);
    if (argc > 4 && strcmp(argv[4], "wait") == 0) {
        char line[16];
        if (!fgets(line, sizeof line, stdin))
            return 1;
    }
    unsigned long x = 1;
    for (long i = 0; i < calls; i++)
        x = busy_alloc_site(size, work, x);
    printf("allocated %ld %llu %lu\n", calls, (unsigned long long)calls * size, x & 1);
    fflush(stdout);
    return 0;
}
