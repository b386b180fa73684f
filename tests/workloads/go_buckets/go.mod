module allocbpf.test/go_buckets

go 1.19
