/*
 * Statically linked. Built with symbols, its own malloc is probed (the executable
 * defines it); built stripped (-s), nothing defines malloc and allocbpf must refuse it
 * clearly. Allocates 64 KiB blocks for 20 s (static_alloc_site), then exits.
 */
#include <stdlib.h>
#include <unistd.h>

__attribute__((noinline)) void static_alloc_site(void) {
    char *volatile p = malloc(64 * 1024);
    p[0] = 1;
    free(p);
}

int main(void) {
    for (int i = 0; i < 100000; i++) {
        static_alloc_site();
        usleep(200);
    }
    return 0;
}
