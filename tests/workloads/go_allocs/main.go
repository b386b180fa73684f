// A Go program with allocation sites of known sizes, for allocbpf's Go tests.
//
// Usage: go_allocs PROFILE|- [ROUNDS [RATE [HOLD_SECONDS]]]. Sets
// runtime.MemProfileRate to RATE if given (0 turns profiling off), prints its pid,
// waits for a line on stdin, runs each site ROUNDS times (keeping the objects of the
// `kept` site alive), forces GC cycles (the runtime publishes its profile counts at
// GC), writes its own heap profile (runtime/pprof, with alloc and in-use values) to
// PROFILE, prints `truth SITE BYTES CALLS LIVE` per site, then stays HOLD_SECONDS
// (default 3) so that its memory can still be read.
package main

import (
	"bufio"
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"
	"strconv"
	"time"
)

// Rounds of each site.
var rounds = 20000

//go:noinline
func allocSmall() *[64]byte { return new([64]byte) }

//go:noinline
func allocMedium() []byte { return make([]byte, 4096) }

//go:noinline
func allocLarge() []byte { return make([]byte, 100000) }

//go:noinline
func allocKept() *[256]byte { return new([256]byte) }

var sink interface{}

func main() {
	hold := 3
	if len(os.Args) > 2 {
		rounds, _ = strconv.Atoi(os.Args[2])
	}
	if len(os.Args) > 3 {
		runtime.MemProfileRate, _ = strconv.Atoi(os.Args[3])
	}
	if len(os.Args) > 4 {
		hold, _ = strconv.Atoi(os.Args[4])
	}
	fmt.Println(os.Getpid())
	in := bufio.NewReader(os.Stdin)
	in.ReadString('\n')
	kept := make([]*[256]byte, 0, rounds)
	for i := 0; i < rounds; i++ {
		sink = allocSmall()
		sink = allocMedium()
		sink = allocLarge()
		kept = append(kept, allocKept())
	}
	sink = nil
	runtime.GC()
	runtime.GC()
	if len(os.Args) > 1 && os.Args[1] != "-" {
		f, err := os.Create(os.Args[1])
		if err == nil {
			pprof.Lookup("heap").WriteTo(f, 0)
			f.Close()
		}
	}
	fmt.Println("truth small", 64, rounds, 0)
	fmt.Println("truth medium", 4096, rounds, 0)
	fmt.Println("truth large", 100000, rounds, 0)
	fmt.Println("truth kept", 256, rounds, len(kept))
	time.Sleep(time.Duration(hold) * time.Second)
	runtime.KeepAlive(kept)
}
