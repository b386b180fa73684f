module allocbpf.test/go_allocs

go 1.19
