/*
 * A steady allocator for the agent tests and the soak bench: for SECONDS (argv[1])
 * seconds, agentwl_alloc_site allocates and frees SIZE (argv[2], default 64 KiB) bytes,
 * then sleeps PAUSE microseconds (argv[3], default 200: with 64 KiB about 320 MiB/s
 * requested, ~5,000 calls/s, far under the default overhead budget), then exits.
 * Prints its pid first.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static size_t size = 64 * 1024;

__attribute__((noinline)) void agentwl_alloc_site(void) {
    char *volatile p = malloc(size);
    p[0] = 1;
    free(p);
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 5.0;
    if (argc > 2)
        size = (size_t)atol(argv[2]);
    useconds_t pause = argc > 3 ? (useconds_t)atol(argv[3]) : 200;
    printf("%d\n", getpid());
    fflush(stdout);
    double end = now() + seconds;
    while (now() < end) {
        agentwl_alloc_site();
        usleep(pause);
    }
    return 0;
}
