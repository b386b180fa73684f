/*
 * Live heap and leaks. Sites that keep their blocks (leak_site: 20 MiB in 4 KiB blocks;
 * realloc_kept: 1 KiB -> 4 KiB -> 16 KiB chains; calloc_kept; memalign_kept
 * (posix_memalign); aligned_kept (aligned_alloc)) run first, then sites whose blocks are
 * all freed (churn_site: 200 MiB in 4 KiB blocks; realloc_freed; calloc_freed;
 * memalign_freed), then the process sleeps 400 ms and exits while still profiled.
 *
 * Protocol as sites.c: prints its pid, waits for a line on stdin, runs, exits.
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define LEAK_BLOCKS 5120
#define CHURN_BLOCKS 51200
#define CHAINS 1000
#define ARRAYS 2000
#define ALIGNED 500

/* volatile: the compiler may not drop allocations whose results are never read. */
static void *volatile kept[LEAK_BLOCKS + CHAINS + 2 * ARRAYS + ALIGNED];
static int n_kept;

__attribute__((noinline)) void leak_site(void) {
    for (int i = 0; i < LEAK_BLOCKS; i++) kept[n_kept++] = malloc(4096);
}

__attribute__((noinline)) void *realloc_chain(void) {
    void *p = malloc(1024);
    p = realloc(p, 4096);
    return realloc(p, 16384);
}

__attribute__((noinline)) void realloc_kept(void) {
    for (int i = 0; i < CHAINS; i++) kept[n_kept++] = realloc_chain();
}

__attribute__((noinline)) void calloc_kept(void) {
    for (int i = 0; i < ARRAYS; i++) kept[n_kept++] = calloc(16, 256);
}

__attribute__((noinline)) void memalign_kept(void) {
    for (int i = 0; i < ARRAYS; i++) {
        void *p = NULL;
        if (posix_memalign(&p, 64, 4096) == 0) kept[n_kept++] = p;
    }
}

__attribute__((noinline)) void aligned_kept(void) {
    for (int i = 0; i < ALIGNED; i++) kept[n_kept++] = aligned_alloc(4096, 8192);
}

__attribute__((noinline)) void churn_site(void) {
    for (int i = 0; i < CHURN_BLOCKS; i++) {
        void *volatile p = malloc(4096);
        free(p);
    }
}

__attribute__((noinline)) void realloc_freed(void) {
    for (int i = 0; i < CHAINS; i++) free(realloc_chain());
}

__attribute__((noinline)) void calloc_freed(void) {
    for (int i = 0; i < ARRAYS; i++) {
        void *volatile p = calloc(16, 256);
        free(p);
    }
}

__attribute__((noinline)) void memalign_freed(void) {
    for (int i = 0; i < ARRAYS; i++) {
        void *p = NULL;
        if (posix_memalign(&p, 64, 4096) == 0) free(p);
    }
}

int main(void) {
    char buf[16];
    printf("%d\n", getpid());
    fflush(stdout);
    if (read(0, buf, sizeof buf) <= 0) return 1;
    leak_site();
    realloc_kept();
    calloc_kept();
    memalign_kept();
    aligned_kept();
    churn_site();
    realloc_freed();
    calloc_freed();
    memalign_freed();
    usleep(400 * 1000);
    return n_kept == 0;
}
