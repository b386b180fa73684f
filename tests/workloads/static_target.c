/* Statically linked: no libc in its memory map. allocbpf must refuse it clearly. */
#include <unistd.h>
int main(void) { sleep(30); return 0; }
