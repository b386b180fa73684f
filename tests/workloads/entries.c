/*
 * Per-entry-point microbenchmark for `cargo xtask bench`: times each named allocation
 * entry, resolved at run time with dlsym (so under LD_PRELOAD the preloaded allocator's
 * entry is the one called), each call paired with the matching deallocation.
 *
 * Usage: entries ITERATIONS NAME...   Prints its pid, waits for a line on stdin (so
 * probes can be attached first), then for each NAME prints
 *   NAME NS_PER_CALL OBJECT
 * where OBJECT is the file the entry was found in, or "absent".
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void *volatile sink;

typedef void *(*size_fn)(size_t);
typedef void *(*size2_fn)(size_t, size_t);
typedef void *(*resize_fn)(void *, size_t);
typedef void *(*resize2_fn)(void *, size_t, size_t);
typedef int (*pm_fn)(void **, size_t, size_t);
typedef void *(*mallocx_fn)(size_t, int);
typedef void *(*rallocx_fn)(void *, size_t, int);
typedef size_t (*xallocx_fn)(void *, size_t, size_t, int);
typedef void (*free_fn)(void *);
typedef void (*free2_fn)(void *, size_t);

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static void *must(const char *name) {
    void *f = dlsym(RTLD_DEFAULT, name);
    if (!f) { fprintf(stderr, "entries: %s not found\n", name); exit(2); }
    return f;
}

/* Runs ITERATIONS calls of entry NAME (at address F); returns ns per call. */
static double run(const char *name, void *f, long n) {
    free_fn dealloc = (free_fn)must("free");
    double start = now_ns();
    if (!strcmp(name, "malloc") || !strcmp(name, "valloc") || !strcmp(name, "pvalloc") ||
        !strcmp(name, "mi_zalloc") || !strcmp(name, "mi_new")) {
        for (long i = 0; i < n; i++) { sink = ((size_fn)f)(32); dealloc(sink); }
    } else if (!strcmp(name, "_Znwm") || !strcmp(name, "_Znam")) {
        free_fn del = (free_fn)must(name[3] == 'w' ? "_ZdlPv" : "_ZdaPv");
        for (long i = 0; i < n; i++) { sink = ((size_fn)f)(32); del(sink); }
    } else if (!strcmp(name, "_ZnwmSt11align_val_t")) {
        free2_fn del = (free2_fn)must("_ZdlPvSt11align_val_t");
        for (long i = 0; i < n; i++) { sink = ((size2_fn)f)(32, 64); del(sink, 64); }
    } else if (!strcmp(name, "calloc") || !strcmp(name, "mi_mallocn")) {
        for (long i = 0; i < n; i++) { sink = ((size2_fn)f)(4, 8); dealloc(sink); }
    } else if (!strcmp(name, "aligned_alloc") || !strcmp(name, "memalign")) {
        for (long i = 0; i < n; i++) { sink = ((size2_fn)f)(64, 64); dealloc(sink); }
    } else if (!strcmp(name, "mi_malloc_aligned") || !strcmp(name, "mi_zalloc_aligned")) {
        for (long i = 0; i < n; i++) { sink = ((size2_fn)f)(64, 64); dealloc(sink); }
    } else if (!strcmp(name, "posix_memalign")) {
        for (long i = 0; i < n; i++) {
            void *p;
            if (((pm_fn)f)(&p, 64, 32) == 0) dealloc(p);
        }
    } else if (!strcmp(name, "realloc") || !strcmp(name, "mi_realloc_aligned")) {
        void *p = malloc(32);
        for (long i = 0; i < n; i++) p = ((resize_fn)f)(p, (i & 1) ? 64 : 32);
        dealloc(p);
    } else if (!strcmp(name, "reallocarray")) {
        void *p = malloc(32);
        for (long i = 0; i < n; i++) p = ((resize2_fn)f)(p, (i & 1) ? 8 : 4, 8);
        dealloc(p);
    } else if (!strcmp(name, "mallocx")) {
        for (long i = 0; i < n; i++) { sink = ((mallocx_fn)f)(32, 0); dealloc(sink); }
    } else if (!strcmp(name, "rallocx")) {
        void *p = malloc(32);
        for (long i = 0; i < n; i++) p = ((rallocx_fn)f)(p, (i & 1) ? 64 : 32, 0);
        dealloc(p);
    } else if (!strcmp(name, "xallocx")) {
        void *p = malloc(64);
        for (long i = 0; i < n; i++) sink = (void *)((xallocx_fn)f)(p, 32, 0, 0);
        dealloc(p);
    } else if (!strncmp(name, "PyObject_", 9) || !strncmp(name, "PyMem_", 6)) {
        /* CPython's allocators (libpython preloaded: they work before the interpreter
         * is initialised), each paired with its own family's Free. */
        char family[32], free_name[48];
        size_t stem = strlen(name) - (strstr(name, "Malloc") ? 6 : strstr(name, "Calloc") ? 6 : 7);
        snprintf(family, sizeof family, "%.*s", (int)stem, name);
        snprintf(free_name, sizeof free_name, "%sFree", family);
        free_fn pyfree = (free_fn)must(free_name);
        if (strstr(name, "Malloc")) {
            for (long i = 0; i < n; i++) { sink = ((size_fn)f)(32); pyfree(sink); }
        } else if (strstr(name, "Calloc")) {
            for (long i = 0; i < n; i++) { sink = ((size2_fn)f)(4, 8); pyfree(sink); }
        } else {
            char malloc_name[48];
            snprintf(malloc_name, sizeof malloc_name, "%sMalloc", family);
            void *p = ((size_fn)must(malloc_name))(32);
            for (long i = 0; i < n; i++) p = ((resize_fn)f)(p, (i & 1) ? 64 : 32);
            pyfree(p);
        }
    } else {
        fprintf(stderr, "entries: no benchmark for %s\n", name);
        exit(2);
    }
    return (now_ns() - start) / n;
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: entries ITERATIONS NAME...\n"); return 2; }
    long n = atol(argv[1]);
    char buf[16];
    printf("%d\n", getpid());
    fflush(stdout);
    if (read(0, buf, sizeof buf) <= 0) return 1;
    for (int i = 2; i < argc; i++) {
        void *f = dlsym(RTLD_DEFAULT, argv[i]);
        Dl_info info;
        if (!f || !dladdr(f, &info) || !info.dli_fname) {
            printf("%s 0 absent\n", argv[i]);
            continue;
        }
        double ns = run(argv[i], f, n);
        printf("%s %.1f %s\n", argv[i], ns, info.dli_fname);
    }
    fflush(stdout);
    return 0;
}
