/*
 * An allocator loaded late, for the dlopen tests: starts on glibc, and only after
 * allocbpf has examined it, dlopen()s a private copy of mimalloc and allocates through
 * its mi_malloc alone.
 *
 * Usage: late_dlopen LIBMIMALLOC SECONDS SIZE PERIOD_US
 * Prints its pid, waits for a line on stdin, then: glibc_site allocates and frees 4096
 * bytes GLIBC_CALLS times through malloc ("glibc CALLS BYTES"); it sleeps 2 s;
 * dlopen()s LIBMIMALLOC ("dlopened"); then for SECONDS seconds mi_site allocates and
 * frees SIZE bytes through mi_malloc/mi_free once every PERIOD_US microseconds, paced
 * on the clock (a late call is made at once, never before its time). At the end it
 * prints "mimalloc CALLS BYTES".
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define GLIBC_CALLS 100
#define GLIBC_SIZE 4096

typedef void *(*malloc_fn)(size_t);
typedef void (*free_fn)(void *);

__attribute__((noinline)) void glibc_site(size_t size) {
    char *volatile p = malloc(size);
    p[0] = 1;
    free(p);
}

__attribute__((noinline)) void mi_site(malloc_fn mi_malloc, free_fn mi_free, size_t size) {
    char *volatile p = mi_malloc(size);
    p[0] = 1;
    mi_free(p);
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: late_dlopen LIBMIMALLOC SECONDS SIZE PERIOD_US\n");
        return 2;
    }
    const char *library = argv[1];
    double seconds = atof(argv[2]);
    size_t size = strtoul(argv[3], NULL, 10);
    long period_ns = atol(argv[4]) * 1000L;
    printf("%d\n", getpid());
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin))
        return 1;
    for (int i = 0; i < GLIBC_CALLS; i++)
        glibc_site(GLIBC_SIZE);
    printf("glibc %d %d\n", GLIBC_CALLS, GLIBC_CALLS * GLIBC_SIZE);
    fflush(stdout);
    sleep(2);
    void *handle = dlopen(library, RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
        fprintf(stderr, "dlopen %s: %s\n", library, dlerror());
        return 1;
    }
    malloc_fn mi_malloc = (malloc_fn)dlsym(handle, "mi_malloc");
    free_fn mi_free = (free_fn)dlsym(handle, "mi_free");
    if (!mi_malloc || !mi_free) {
        fprintf(stderr, "%s: no mi_malloc or mi_free\n", library);
        return 1;
    }
    printf("dlopened\n");
    fflush(stdout);
    struct timespec next;
    clock_gettime(CLOCK_MONOTONIC, &next);
    long calls = (long)(seconds * 1e9 / period_ns);
    for (long i = 0; i < calls; i++) {
        mi_site(mi_malloc, mi_free, size);
        next.tv_nsec += period_ns;
        while (next.tv_nsec >= 1000000000L) {
            next.tv_nsec -= 1000000000L;
            next.tv_sec += 1;
        }
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL);
    }
    printf("mimalloc %ld %llu\n", calls, (unsigned long long)calls * size);
    fflush(stdout);
    return 0;
}
