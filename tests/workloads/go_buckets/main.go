// Go workloads for allocbpf's Go cost benchmark (tests/src/bin/go_cost.rs).
//
// `go_buckets buckets DEPTHS SIZES`: records every allocation (MemProfileRate = 1) of
// SIZES distinct sizes at DEPTHS distinct stack depths, so that its heap profile holds
// about DEPTHS x SIZES buckets; prints its pid, then `ready`, then waits for stdin to
// close.
//
// `go_buckets throughput SECONDS`: prints its pid, waits for a line, then allocates
// 1 KiB slices for SECONDS (at the default sampling rate) and prints how many it made
// per second of wall time and per second of its own CPU time.
package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"runtime"
	"runtime/pprof"
	"strconv"
	"syscall"
	"time"
)

// cpuSeconds is the process's user and system time.
func cpuSeconds() float64 {
	var usage syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &usage)
	return float64(usage.Utime.Nano()+usage.Stime.Nano()) / 1e9
}

var sink []byte

//go:noinline
func at(depth, size int) {
	if depth > 0 {
		at(depth-1, size)
		return
	}
	sink = make([]byte, size)
}

func main() {
	fmt.Println(os.Getpid())
	switch os.Args[1] {
	case "buckets":
		runtime.MemProfileRate = 1
		depths, _ := strconv.Atoi(os.Args[2])
		sizes, _ := strconv.Atoi(os.Args[3])
		for d := 0; d < depths; d++ {
			for s := 0; s < sizes; s++ {
				// Sizes 16 bytes apart: distinct size classes up to 256 bytes,
				// distinct rounded sizes past them.
				at(d, 16+16*s)
			}
		}
		runtime.GC()
		runtime.GC()
		pprof.Lookup("heap").WriteTo(io.Discard, 0)
		fmt.Println("ready")
		io.Copy(io.Discard, os.Stdin)
	case "throughput":
		seconds, _ := strconv.Atoi(os.Args[2])
		bufio.NewReader(os.Stdin).ReadString('\n')
		cpu := cpuSeconds()
		deadline := time.Now().Add(time.Duration(seconds) * time.Second)
		count := 0
		for time.Now().Before(deadline) {
			for i := 0; i < 1000; i++ {
				sink = make([]byte, 1024)
			}
			count += 1000
		}
		pprof.Lookup("heap").WriteTo(io.Discard, 0)
		fmt.Println(float64(count)/float64(seconds), float64(count)/(cpuSeconds()-cpu))
	}
}
