module allocbpf.test/go_cgo

go 1.19
