/*
 * A process that looks like CPython 3.11 to allocbpf and lies in every structure it
 * reads: allocbpf's adversary for Python frames (tests/tests/python.rs).
 *
 * It exports `_PyRuntime`, `PyCode_Type`, `PyUnicode_Type` and `Py_Version` (3.11) and
 * its file name says python, so allocbpf walks its "frames". The GIL holder's thread
 * state names the allocating thread; its frame chain is a cycle through three frames:
 * - a code object whose name claims 2^40 characters and whose line table claims 2^40
 *   bytes (reads must be cut, not sized by the claim);
 * - a code object whose name is not a compact string (it must be refused);
 * - a frame whose code pointer points at unmapped memory.
 * A second thread allocates too, without the "GIL": its thread state must be looked for
 * in the interpreter's list of thread states, which is a cycle of two that never names
 * it (the look must stop, and its samples come without Python frames).
 * Then both call malloc/free in a loop like any program. Prints its pid, waits for a
 * line on stdin, allocates for the seconds given (default 2), prints "done".
 *
 * Offsets are CPython 3.11's (userspace/python/src/layout.rs).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>

__attribute__((visibility("default"))) unsigned char _PyRuntime[4096];
__attribute__((visibility("default"))) unsigned char PyCode_Type[512];
__attribute__((visibility("default"))) unsigned char PyUnicode_Type[512];
__attribute__((visibility("default"))) const unsigned long Py_Version = 0x030b02f0;

static void put(unsigned char *base, size_t offset, uint64_t value) {
    memcpy(base + offset, &value, sizeof value);
}

/* A compact ASCII str claiming `length` characters, with `text` after its header. */
static unsigned char *str(uint64_t length, const char *text, int compact) {
    unsigned char *s = calloc(1, 48 + 64);
    put(s, 8, (uint64_t)(uintptr_t)PyUnicode_Type);
    put(s, 16, length);
    /* state: kind 1 (bits 2-4), compact (bit 5), ascii (bit 6), ready (bit 7). */
    uint32_t state = (1u << 2) | (compact ? 1u << 5 : 0) | (1u << 6) | (1u << 7);
    memcpy(s + 32, &state, sizeof state);
    strcpy((char *)s + 48, text);
    return s;
}

static unsigned char *code(unsigned char *name, unsigned char *table) {
    unsigned char *c = calloc(1, 512);
    put(c, 8, (uint64_t)(uintptr_t)PyCode_Type);
    put(c, 72, 1);                                  /* co_firstlineno */
    put(c, 112, (uint64_t)(uintptr_t)str(7, "forged!", 1)); /* co_filename */
    put(c, 120, (uint64_t)(uintptr_t)name);         /* co_name */
    put(c, 128, (uint64_t)(uintptr_t)name);         /* co_qualname */
    put(c, 136, (uint64_t)(uintptr_t)table);        /* co_linetable */
    return c;
}

static double seconds = 2;

/* malloc/free pairs for `seconds` from the first call. */
static void *allocate_for_a_while(void *unused) {
    (void)unused;
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    /* Through volatile pointers: the compiler may not pair the calls away. */
    void *(*volatile allocate)(size_t) = malloc;
    void (*volatile release)(void *) = free;
    do {
        for (int i = 0; i < 10000; i++) release(allocate(4096));
        clock_gettime(CLOCK_MONOTONIC, &now);
    } while ((now.tv_sec - start.tv_sec) + (now.tv_nsec - start.tv_nsec) / 1e9 < seconds);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc > 1) seconds = atof(argv[1]);
    unsigned char *table = calloc(1, 64);
    put(table, 16, 1ull << 40);                     /* ob_size */
    unsigned char *huge = code(str(1ull << 40, "a_name_that_claims_a_terabyte", 1), table);
    unsigned char *loose = code(str(5, "loose", 0), table);

    unsigned char *frames[3];
    for (int i = 0; i < 3; i++) frames[i] = calloc(1, 128);
    put(frames[0], 32, (uint64_t)(uintptr_t)huge);
    put(frames[1], 32, (uint64_t)(uintptr_t)loose);
    put(frames[2], 32, 0x10);                       /* unmapped */
    for (int i = 0; i < 3; i++) {
        put(frames[i], 48, (uint64_t)(uintptr_t)frames[(i + 1) % 3]); /* previous: a cycle */
        put(frames[i], 56, (uint64_t)(uintptr_t)frames[i] + 1);       /* prev_instr */
        frames[i][68] = 0;                                            /* is_entry */
    }
    unsigned char *cframe = calloc(1, 64);
    put(cframe, 8, (uint64_t)(uintptr_t)frames[0]);
    unsigned char *tstate = calloc(1, 512);
    put(tstate, 56, (uint64_t)(uintptr_t)cframe);
    put(tstate, 160, (uint64_t)syscall(SYS_gettid));
    unsigned char *interpreter = calloc(1, 4096);
    unsigned char *cycle[2] = {calloc(1, 512), calloc(1, 512)};
    put(cycle[0], 8, (uint64_t)(uintptr_t)cycle[1]);  /* next */
    put(cycle[1], 8, (uint64_t)(uintptr_t)cycle[0]);  /* next: a cycle */
    put(interpreter, 16, (uint64_t)(uintptr_t)cycle[0]); /* threads.head */
    put(_PyRuntime, 48, (uint64_t)(uintptr_t)interpreter); /* interpreters.main */
    put(_PyRuntime, 576, (uint64_t)(uintptr_t)tstate);          /* gilstate.tstate_current */

    printf("%d\n", getpid());
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 1;
    pthread_t other;
    if (pthread_create(&other, NULL, allocate_for_a_while, NULL) != 0) return 1;
    allocate_for_a_while(NULL);
    pthread_join(other, NULL);
    printf("done\n");
    return 0;
}
