/*
 * A short batch job's shape: three bursts of allocation in about half a second, for
 * the overhead-budget tests of short and bursty processes. 100,000 malloc(64) kept
 * until the end, 40 malloc(1 MiB), then 1,000 calloc(1, 10000), with PAUSE_MS
 * (argv[1], default 100) between the bursts. Prints its pid first and, at the end,
 * "allocated CALLS BYTES": the truth the profiler's estimate is compared with.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define SMALL 100000
#define LARGE 40
#define ZEROED 1000

static void pause_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

__attribute__((noinline)) void burst_small(char **kept) {
    for (long i = 0; i < SMALL; i++) {
        kept[i] = malloc(64);
        kept[i][0] = (char)i;
    }
}

__attribute__((noinline)) void burst_large(void) {
    for (int i = 0; i < LARGE; i++) {
        char *volatile p = malloc(1 << 20);
        p[0] = 1;
        free(p);
    }
}

__attribute__((noinline)) void burst_zeroed(void) {
    for (int i = 0; i < ZEROED; i++) {
        char *volatile p = calloc(1, 10000);
        p[1] = 1;
        free(p);
    }
}

int main(int argc, char **argv) {
    long pause = argc > 1 ? atol(argv[1]) : 100;
    printf("%d\n", getpid());
    fflush(stdout);
    char **kept = malloc(SMALL * sizeof *kept);
    burst_small(kept);
    pause_ms(pause);
    burst_large();
    pause_ms(pause);
    burst_zeroed();
    for (long i = 0; i < SMALL; i++)
        free(kept[i]);
    unsigned long long bytes = (unsigned long long)SMALL * 64 + (unsigned long long)LARGE * (1 << 20) +
                               (unsigned long long)ZEROED * 10000;
    /* The array of kept pointers is a malloc too. */
    bytes += SMALL * sizeof *kept;
    printf("allocated %d %llu\n", SMALL + LARGE + ZEROED + 1, bytes);
    fflush(stdout);
    return 0;
}
