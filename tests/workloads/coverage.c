/*
 * Interval coverage end to end. 4,000 sites, site_1000 .. site_4999, each a noinline
 * function that calls malloc directly with its own block size, log-uniform between
 * 1 KiB and 192 KiB (3 x the test rate of 64 KiB). Each round, a site allocates
 * ceil(64 KiB / size) blocks (at least one), so over 64 rounds every site expects
 * about 60 samples. Two threads: even sites on one, odd sites on the other, so the
 * test also sees two threads' interval draws. A 15 ms pause after each round keeps the
 * sample rate (~4,000 per round, 4.3 MB) inside the 8 MiB ring buffer.
 *
 * Protocol as sites.c: prints its pid, waits for a line on stdin, runs, then prints
 * "truth <site> <size> <calls>" for every site and "done".
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define FIRST_SITE 1000
#define SITES 4000
#define ROUNDS 64
#define RATE (64 * 1024)

static size_t site_size(int site) {
    double f = (double)(((site - FIRST_SITE) * 7919) % SITES) / SITES;
    return (size_t)(1024.0 * exp(f * log(192.0)));
}

static size_t per_round(size_t size) { return (RATE + size - 1) / size; }

#define SITE(n)                                                  \
    __attribute__((noinline)) void site_##n(void) {              \
        size_t size = site_size(n), calls = per_round(size);     \
        for (size_t i = 0; i < calls; i++) {                     \
            void *volatile block = malloc(size);                 \
            free(block);                                         \
        }                                                        \
    }
#define S10(p) SITE(p##0) SITE(p##1) SITE(p##2) SITE(p##3) SITE(p##4) \
               SITE(p##5) SITE(p##6) SITE(p##7) SITE(p##8) SITE(p##9)
#define S100(p) S10(p##0) S10(p##1) S10(p##2) S10(p##3) S10(p##4) \
                S10(p##5) S10(p##6) S10(p##7) S10(p##8) S10(p##9)
#define S1000(p) S100(p##0) S100(p##1) S100(p##2) S100(p##3) S100(p##4) \
                 S100(p##5) S100(p##6) S100(p##7) S100(p##8) S100(p##9)
S1000(1)
S1000(2)
S1000(3)
S1000(4)

#define F(n) site_##n,
#define F10(p) F(p##0) F(p##1) F(p##2) F(p##3) F(p##4) F(p##5) F(p##6) F(p##7) F(p##8) F(p##9)
#define F100(p) F10(p##0) F10(p##1) F10(p##2) F10(p##3) F10(p##4) \
                F10(p##5) F10(p##6) F10(p##7) F10(p##8) F10(p##9)
#define F1000(p) F100(p##0) F100(p##1) F100(p##2) F100(p##3) F100(p##4) \
                 F100(p##5) F100(p##6) F100(p##7) F100(p##8) F100(p##9)
static void (*const sites[SITES])(void) = {F1000(1) F1000(2) F1000(3) F1000(4)};

static void *worker(void *arg) {
    long parity = (long)arg;
    struct timespec pause = {0, 15 * 1000 * 1000};
    for (int round = 0; round < ROUNDS; round++) {
        for (int i = parity; i < SITES; i += 2) sites[i]();
        nanosleep(&pause, NULL);
    }
    return NULL;
}

int main(void) {
    char buf[16];
    printf("%d\n", getpid());
    fflush(stdout);
    if (read(0, buf, sizeof buf) <= 0) return 1;
    pthread_t threads[2];
    for (long t = 0; t < 2; t++) pthread_create(&threads[t], NULL, worker, (void *)t);
    for (int t = 0; t < 2; t++) pthread_join(threads[t], NULL);
    for (int i = 0; i < SITES; i++) {
        size_t size = site_size(FIRST_SITE + i);
        printf("truth site_%d %zu %zu\n", FIRST_SITE + i, size, ROUNDS * per_round(size));
    }
    printf("done\n");
    return 0;
}
