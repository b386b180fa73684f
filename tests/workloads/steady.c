/*
 * A steady allocator with a known byte rate, for the overhead-budget tests: for
 * SECONDS (argv[1]) seconds, steady_alloc_site allocates and frees SIZE (argv[2])
 * bytes PER_PERIOD (argv[4], default 1) times every PERIOD_US (argv[3]) microseconds,
 * paced on the clock (not on sleeps, which drift). With "wait" (argv[5]) it waits for a
 * line on stdin first. Prints its pid first and, at the end, "allocated CALLS BYTES":
 * the truth the profiler's estimate is compared with.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

__attribute__((noinline)) void steady_alloc_site(size_t size) {
    char *volatile p = malloc(size);
    p[0] = 1;
    free(p);
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 5.0;
    size_t size = argc > 2 ? strtoul(argv[2], NULL, 10) : 262144;
    long period_ns = (argc > 3 ? atol(argv[3]) : 1000) * 1000L;
    long per_period = argc > 4 ? atol(argv[4]) : 1;
    printf("%d\n", getpid());
    fflush(stdout);
    if (argc > 5 && strcmp(argv[5], "wait") == 0) {
        char line[16];
        if (!fgets(line, sizeof line, stdin))
            return 1;
    }
    struct timespec next;
    clock_gettime(CLOCK_MONOTONIC, &next);
    long periods = (long)(seconds * 1e9 / period_ns);
    long calls = periods * per_period;
    for (long i = 0; i < periods; i++) {
        for (long j = 0; j < per_period; j++)
            steady_alloc_site(size);
        next.tv_nsec += period_ns;
        while (next.tv_nsec >= 1000000000L) {
            next.tv_nsec -= 1000000000L;
            next.tv_sec += 1;
        }
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL);
    }
    printf("allocated %ld %llu\n", calls, (unsigned long long)calls * size);
    fflush(stdout);
    return 0;
}
