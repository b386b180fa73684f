// A cgo program for allocbpf's Go tests: Go allocations (read from the runtime's heap
// profile) and C allocations through malloc (probed), in one process.
//
// Usage: go_cgo [ROUNDS [PROFILE]]. Prints its pid, waits for a line on stdin, then per
// round makes one 4096-byte Go slice and mallocs (and frees) 3000 bytes from C, forces
// GC cycles, writes its own heap profile to PROFILE (if given), prints
// `truth SITE BYTES CALLS` per site, and stays 3 s to be read.
package main

/*
#include <stdlib.h>

__attribute__((noinline)) void c_allocate(void) {
	void *volatile p = malloc(3000);
	free(p);
}
*/
import "C"

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"runtime"
	"runtime/pprof"
	"strconv"
	"time"
)

var sink []byte

//go:noinline
func goAllocate() { sink = make([]byte, 4096) }

func main() {
	rounds := 20000
	if len(os.Args) > 1 {
		rounds, _ = strconv.Atoi(os.Args[1])
	}
	fmt.Println(os.Getpid())
	bufio.NewReader(os.Stdin).ReadString('\n')
	for i := 0; i < rounds; i++ {
		goAllocate()
		C.c_allocate()
	}
	runtime.GC()
	runtime.GC()
	// Reading its own profile keeps the runtime sampling: a program that never reads
	// it has MemProfileRate set to 0 by the linker.
	var out io.Writer = io.Discard
	if len(os.Args) > 2 {
		if f, err := os.Create(os.Args[2]); err == nil {
			defer f.Close()
			out = f
		}
	}
	pprof.Lookup("heap").WriteTo(out, 0)
	fmt.Println("truth go", 4096, rounds)
	fmt.Println("truth c", 3000, rounds)
	time.Sleep(3 * time.Second)
}
