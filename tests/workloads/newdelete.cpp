/*
 * C++ operator new/delete at known sites, for allocbpf's allocator tests: run as is
 * (libstdc++'s operators, which call glibc's malloc), or with LD_PRELOAD of jemalloc,
 * tcmalloc or mimalloc, whose own operators replace them (jemalloc's inline their fast
 * path and never call malloc).
 *
 * Protocol as sites.c: prints its pid, waits for a line on stdin, runs every site,
 * prints "done", sleeps 300 ms (so its blocks are seen live) and exits. No iostream:
 * write(2) only, so nothing but the sites allocates while profiled.
 *
 * Truth (tests/tests/allocators.rs): 62,000 calls, 120,832,000 bytes.
 */
#include <cstring>
#include <new>
#include <unistd.h>

#define NOINLINE __attribute__((noinline))

struct Block { char bytes[1024]; };
struct Page { char bytes[4096]; };
struct alignas(64) Aligned { char bytes[1024]; };

/* Keeps the compiler from eliding allocations (C++14 allows merging new/delete). */
static void *volatile sink;
static Page *kept[2000];

static void say(const char *s) { (void)!write(1, s, strlen(s)); }

/* 20,000 x operator new(1024). */
extern "C" NOINLINE void site_new(void) {
    for (int i = 0; i < 20000; i++) { Block *b = new Block; sink = b; delete b; }
}

/* 20,000 x operator new[](2048). */
extern "C" NOINLINE void site_new_array(void) {
    for (int i = 0; i < 20000; i++) { char *a = new char[2048]; sink = a; delete[] a; }
}

/* 10,000 x operator new[](4096, nothrow). */
extern "C" NOINLINE void site_new_nothrow(void) {
    for (int i = 0; i < 10000; i++) {
        char *a = new (std::nothrow) char[4096];
        sink = a;
        delete[] a;
    }
}

/* 10,000 x operator new(1024, align_val_t(64)). */
extern "C" NOINLINE void site_new_aligned(void) {
    for (int i = 0; i < 10000; i++) { Aligned *a = new Aligned; sink = a; delete a; }
}

/* 2,000 x operator new(4096), kept until exit. */
extern "C" NOINLINE void site_new_kept(void) {
    for (int i = 0; i < 2000; i++) kept[i] = new Page;
    sink = kept;
}

extern "C" NOINLINE void run_sites(void) {
    site_new();
    site_new_array();
    site_new_nothrow();
    site_new_aligned();
    site_new_kept();
}

int main() {
    char buf[64];
    char line[32];
    int n = 0;
    pid_t pid = getpid();
    char digits[16];
    int d = 0;
    do { digits[d++] = '0' + pid % 10; pid /= 10; } while (pid);
    while (d) line[n++] = digits[--d];
    line[n++] = '\n';
    (void)!write(1, line, n);
    if (read(0, buf, sizeof buf) <= 0) return 1;
    run_sites();
    say("done\n");
    usleep(300000);
    return 0;
}
