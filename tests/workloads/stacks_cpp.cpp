// C++ allocations through libstdc++'s operator new, built -O2 -fomit-frame-pointer -g:
// main -> widgets::build_all -> widgets::Factory::make(int) -> operator new[] ->
// operator new -> malloc. Protocol as sites.c.
#include <cstdio>
#include <unistd.h>

namespace widgets {

struct Widget {
    char payload[1000];
};

volatile long checksum;

class Factory {
public:
    __attribute__((noinline)) Widget *make(int count) {
        Widget *w = new Widget[count];
        w[0].payload[0] = 1;
        checksum += count;
        return w;
    }
};

__attribute__((noinline)) void build_all(int rounds) {
    Factory factory;
    for (int i = 0; i < rounds; i++) {
        Widget *w = factory.make(4);
        checksum += w[0].payload[0];
        delete[] w;
    }
}

}  // namespace widgets

int main() {
    char buf[16];
    std::printf("%d\n", getpid());
    std::fflush(stdout);
    if (read(0, buf, sizeof buf) <= 0) return 1;
    widgets::build_all(20000);
    return 0;
}
