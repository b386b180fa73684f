/*
 * A process that maps huge files executable, for the hostile tests: an 8 GiB sparse
 * file (over the profiler's size cap) and a 400 MiB sparse file that starts like an ELF
 * file but is not one. A profiler that reads what a process maps must neither read
 * gigabytes nor hold hundreds of MB for them. Then it allocates until killed.
 *
 * Usage: hugemap DIR   Prints its pid, then "mapped".
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static void *volatile sink;

static void *map_sparse(const char *dir, const char *name, off_t size, const char *head) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (fd < 0 || ftruncate(fd, size) != 0) {
        perror(path);
        exit(1);
    }
    if (head && pwrite(fd, head, 64, 0) != 64) {
        perror("pwrite");
        exit(1);
    }
    void *p = mmap(NULL, (size_t)size, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    close(fd);
    return p;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: hugemap DIR\n");
        return 2;
    }
    printf("%d\n", getpid());
    fflush(stdout);
    /* An ELF identification (64-bit, little-endian) over headers that lead nowhere. */
    char elf[64] = "\x7f" "ELF\x02\x01\x01";
    map_sparse(argv[1], "huge.bin", (off_t)8 << 30, NULL);
    map_sparse(argv[1], "fake.so", (off_t)400 << 20, elf);
    printf("mapped\n");
    fflush(stdout);
    struct timespec pause = {0, 1000000};
    for (;;) {
        for (int i = 0; i < 100; i++) {
            sink = malloc(4096);
            free(sink);
        }
        nanosleep(&pause, NULL);
    }
}
