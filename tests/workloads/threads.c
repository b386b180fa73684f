/*
 * 16 threads, each making 20,000 malloc(256) calls from site_thread, then exiting;
 * the main thread joins them and exits. allocbpf's exact totals must include the
 * threads that exited before the process (their per-thread entries are folded into
 * the process totals by the thread-exit tracepoint).
 *
 * Protocol as sites.c: prints its pid, waits for a line on stdin, prints "done".
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define THREADS 16
#define CALLS 20000

__attribute__((noinline)) void site_thread(void) {
    for (int i = 0; i < CALLS; i++) {
        /* Thread-local and volatile: the allocation cannot be elided, and no other
         * thread can free it (a shared variable here is a double free). */
        void *volatile block = malloc(256);
        free(block);
    }
}

static void *worker(void *arg) { (void)arg; site_thread(); return NULL; }

int main(void) {
    char line[32], buf[16];
    int n = 0, d = 0;
    char digits[16];
    pid_t pid = getpid();
    do { digits[d++] = '0' + pid % 10; pid /= 10; } while (pid);
    while (d) line[n++] = digits[--d];
    line[n++] = '\n';
    (void)!write(1, line, n);
    if (read(0, buf, sizeof buf) <= 0) return 1;
    pthread_t threads[THREADS];
    for (int i = 0; i < THREADS; i++) pthread_create(&threads[i], NULL, worker, NULL);
    for (int i = 0; i < THREADS; i++) pthread_join(threads[i], NULL);
    (void)!write(1, "done\n", 5);
    return 0;
}
