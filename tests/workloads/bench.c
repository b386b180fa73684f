/*
 * malloc microbenchmark for `cargo xtask bench`: prints its pid, waits for a line on
 * stdin (so probes can be attached first), then times ITERATIONS malloc(32)+free pairs
 * and prints the mean nanoseconds per pair.
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static void *volatile sink;

int main(int argc, char **argv) {
    long iterations = argc > 1 ? atol(argv[1]) : 1000000;
    char buf[16];
    printf("%d\n", getpid());
    fflush(stdout);
    if (read(0, buf, sizeof buf) <= 0) return 1;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < iterations; i++) { sink = malloc(32); free(sink); }
    clock_gettime(CLOCK_MONOTONIC, &b);
    double ns = (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
    printf("%.1f\n", ns / iterations);
    return 0;
}
