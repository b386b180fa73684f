/*
 * A process that looks like a HotSpot JVM to allocbpf and lies in the tables it reads:
 * allocbpf's adversary for the JVM (tests/tests/jvm.rs). Copied to a file named
 * libjvm.so and run from there, so that its own mapping is "libjvm.so"; built with
 * -rdynamic, it exports every gHotSpotVM* symbol HotSpot does. Its structure table
 * lies as its first argument says:
 * - endless: 20,000 well-formed entries and no terminator (the read must stop);
 * - stride:  an entry stride of 2^40 bytes (refused before any entry is read);
 * - name:    a type name of 64 KiB without its terminating NUL (cut, refused);
 * - loop:    every name pointer points at the table itself (garbage names, refused).
 * It also defines HotSpot's allocation tracer functions (their mangled names) and calls
 * them with forged class and thread pointers, as a JVM's TLAB refills would: their
 * samples must be counted, without Java frames, and never crash or hang anything.
 * Prints its pid, waits for a line on stdin, allocates for 2 s (malloc and the
 * tracer), prints "done".
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define ENTRIES 20000
#define STRIDE 48

struct entry {
    const char *type_name;
    const char *field_name;
    const char *type_string;
    int32_t is_static;
    uint64_t offset;
    void *address;
};

static struct entry table[ENTRIES + 1];
static char long_name[64 << 10];

#define EXPORT __attribute__((visibility("default")))
EXPORT struct entry *gHotSpotVMStructs = table;
EXPORT uint64_t gHotSpotVMStructEntryArrayStride = STRIDE;
EXPORT uint64_t gHotSpotVMStructEntryTypeNameOffset = 0;
EXPORT uint64_t gHotSpotVMStructEntryFieldNameOffset = 8;
EXPORT uint64_t gHotSpotVMStructEntryTypeStringOffset = 16;
EXPORT uint64_t gHotSpotVMStructEntryIsStaticOffset = 24;
EXPORT uint64_t gHotSpotVMStructEntryOffsetOffset = 32;
EXPORT uint64_t gHotSpotVMStructEntryAddressOffset = 40;
EXPORT struct entry *gHotSpotVMTypes = table;
EXPORT uint64_t gHotSpotVMTypeEntryArrayStride = STRIDE;
EXPORT uint64_t gHotSpotVMTypeEntryTypeNameOffset = 0;
EXPORT uint64_t gHotSpotVMTypeEntrySuperclassNameOffset = 8;
EXPORT uint64_t gHotSpotVMTypeEntryIsOopTypeOffset = 16;
EXPORT uint64_t gHotSpotVMTypeEntryIsIntegerTypeOffset = 20;
EXPORT uint64_t gHotSpotVMTypeEntryIsUnsignedOffset = 24;
EXPORT uint64_t gHotSpotVMTypeEntrySizeOffset = 32;
EXPORT struct entry *gHotSpotVMIntConstants = table;
EXPORT uint64_t gHotSpotVMIntConstantEntryArrayStride = STRIDE;
EXPORT uint64_t gHotSpotVMIntConstantEntryNameOffset = 0;
EXPORT uint64_t gHotSpotVMIntConstantEntryValueOffset = 8;
EXPORT struct entry *gHotSpotVMLongConstants = table;
EXPORT uint64_t gHotSpotVMLongConstantEntryArrayStride = STRIDE;
EXPORT uint64_t gHotSpotVMLongConstantEntryNameOffset = 0;
EXPORT uint64_t gHotSpotVMLongConstantEntryValueOffset = 8;

/* HotSpot's tracer, under its mangled names (what allocbpf probes). */
EXPORT __attribute__((noinline)) void new_tlab(void *klass, void *obj, size_t tlab, size_t size,
                                               void *thread)
    __asm__("_ZN11AllocTracer27send_allocation_in_new_tlabEP5KlassPP12HeapWordImplmmP10JavaThread");
EXPORT __attribute__((noinline)) void new_tlab(void *klass, void *obj, size_t tlab, size_t size,
                                               void *thread) {
    __asm__ volatile("" ::"r"(klass), "r"(obj), "r"(tlab), "r"(size), "r"(thread) : "memory");
}
EXPORT __attribute__((noinline)) void outside_tlab(void *klass, void *obj, size_t size, void *thread)
    __asm__("_ZN11AllocTracer28send_allocation_outside_tlabEP5KlassPP12HeapWordImplmP10JavaThread");
EXPORT __attribute__((noinline)) void outside_tlab(void *klass, void *obj, size_t size, void *thread) {
    __asm__ volatile("" ::"r"(klass), "r"(obj), "r"(size), "r"(thread) : "memory");
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "endless";
    memset(long_name, 'A', sizeof long_name);
    for (int i = 0; i < ENTRIES; i++) {
        table[i].type_name = "JavaThread";
        table[i].field_name = "_anchor";
        table[i].type_string = "JavaFrameAnchor";
        table[i].offset = (uint64_t)i * 8;
    }
    if (strcmp(mode, "stride") == 0) {
        gHotSpotVMStructEntryArrayStride = 1ull << 40;
    } else if (strcmp(mode, "name") == 0) {
        table[0].type_name = long_name;
    } else if (strcmp(mode, "loop") == 0) {
        for (int i = 0; i < ENTRIES; i++) {
            table[i].type_name = (const char *)&table[i];
            table[i].field_name = (const char *)table;
        }
    }
    printf("%d\n", (int)getpid());
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) {
        return 1;
    }
    /* Forged class and thread pointers: one unmapped, one pointing at the table. */
    void *thread = (void *)table, *klass = (void *)0x10;
    double end = now() + 2.0;
    unsigned long calls = 0;
    while (now() < end) {
        for (int i = 0; i < 1000; i++) {
            void *p = malloc(256 + i);
            new_tlab(klass, p, 1 << 20, 256, thread);
            outside_tlab(klass, p, 8 << 20, (void *)0x8);
            free(p);
            calls++;
        }
    }
    printf("done %lu\n", calls);
    return 0;
}
