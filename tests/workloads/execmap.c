/*
 * A process that maps a file executable, for the hostile-ELF test: the file is the
 * test's (a sparse ELF whose headers make reading it cost without end), the process
 * only maps it, PROT_READ|PROT_EXEC and MAP_PRIVATE as a loader maps code, and runs
 * nothing in it.
 *
 * Usage: execmap FILE SECONDS   Prints its pid, then "mapped" once FILE is mapped; then
 * for SECONDS seconds execmap_alloc_site allocates and frees 64 KiB every 100 us
 * (through the C library, which the profiler probes), then exits.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

__attribute__((noinline)) void execmap_alloc_site(void) {
    char *volatile p = malloc(64 * 1024);
    p[0] = 1;
    free(p);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: execmap FILE SECONDS\n");
        return 2;
    }
    printf("%d\n", getpid());
    fflush(stdout);
    int fd = open(argv[1], O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        perror(argv[1]);
        return 1;
    }
    void *mapped = mmap(NULL, st.st_size, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0);
    if (mapped == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    printf("mapped\n");
    fflush(stdout);
    double end = now() + atof(argv[2]);
    while (now() < end) {
        execmap_alloc_site();
        usleep(100);
    }
    munmap(mapped, st.st_size);
    close(fd);
    return 0;
}
