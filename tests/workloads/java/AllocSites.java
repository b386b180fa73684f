// A Java workload with known allocation sites, for allocbpf's JVM tests (the workload
// protocol: prints its pid, waits for "go" on stdin, allocates, prints its truth, exits).
//
// The main thread picks one of two sites at random at each iteration (a fixed seed), so
// that the object that crosses a TLAB's end is a random one, with probability
// proportional to its size: the JVM estimator's premise (docs/statistics.md, "JVM").
// A second thread allocates big arrays outside any TLAB meanwhile: on the main thread
// they would retire its TLAB now and then, and the next TLAB would go to an object
// picked by count, not by size (the bias that section bounds).
//
// Sites:
//   smallArray  new byte[1024], in a method the JIT inlines into its caller;
//   point       new Point (three longs), a class of a known size;
//   bigArray    new long[1 << 19] (4 MiB), outside any TLAB, on the second thread.
//
// Each site's bytes per object are measured, not assumed, with the thread's own
// allocation counter (com.sun.management.ThreadMXBean#getThreadAllocatedBytes).
// Prints `site NAME COUNT BYTES_EACH` per site, the number of garbage collections
// during the run (each retires every TLAB), and the run's nanoseconds (what the
// benchmark times).
//
// Usage: java AllocSites ITERATIONS SEED BIG_ARRAYS
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.lang.management.ManagementFactory;
import java.util.SplittableRandom;

public class AllocSites {
    static volatile Object sink;
    static volatile Object bigSink;

    static final class Point {
        long x, y, z;

        Point(long v) {
            x = v;
            y = v + 1;
            z = v + 2;
        }
    }

    static byte[] smallArray() {
        return new byte[1024];
    }

    static void smallSite() {
        sink = smallArray();
    }

    static void pointSite(long i) {
        sink = new Point(i);
    }

    static void bigSite() {
        bigSink = new long[1 << 19];
    }

    static final com.sun.management.ThreadMXBean THREADS =
            (com.sun.management.ThreadMXBean) ManagementFactory.getThreadMXBean();

    static long allocated() {
        return THREADS.getThreadAllocatedBytes(Thread.currentThread().getId());
    }

    /** Garbage collections so far. */
    static long collections() {
        long n = 0;
        for (var gc : ManagementFactory.getGarbageCollectorMXBeans()) {
            n += Math.max(0, gc.getCollectionCount());
        }
        return n;
    }

    /** Bytes one object of `site` takes, measured over many. */
    static long bytesPerObject(int site) {
        int n = site == 2 ? 16 : 100_000;
        long before = allocated();
        for (int i = 0; i < n; i++) {
            run(site, i);
        }
        long after = allocated();
        return Math.round((double) (after - before) / n);
    }

    static void run(int site, long i) {
        switch (site) {
            case 0 -> smallSite();
            case 1 -> pointSite(i);
            default -> bigSite();
        }
    }

    /** 15% small arrays, 85% points. */
    static long[] loop(long iterations, long seed) {
        SplittableRandom random = new SplittableRandom(seed);
        long[] counts = new long[2];
        for (long i = 0; i < iterations; i++) {
            int site = random.nextInt(100) < 15 ? 0 : 1;
            counts[site]++;
            run(site, i);
        }
        return counts;
    }

    static void bigLoop(long count) {
        for (long i = 0; i < count; i++) {
            bigSite();
        }
    }

    public static void main(String[] args) throws Exception {
        long iterations = Long.parseLong(args[0]);
        long seed = Long.parseLong(args[1]);
        long bigArrays = Long.parseLong(args[2]);
        // Warm up: the loops and their sites compiled (and the inlining done) before
        // profiling starts.
        loop(Math.min(iterations, 3_000_000), seed + 1);
        bigLoop(200);
        long[] size = {bytesPerObject(0), bytesPerObject(1), bytesPerObject(2)};
        System.out.println(ProcessHandle.current().pid());
        System.out.flush();
        new BufferedReader(new InputStreamReader(System.in)).readLine();
        long gcsBefore = collections();
        long started = System.nanoTime();
        Thread big = new Thread(() -> bigLoop(bigArrays), "big-arrays");
        big.start();
        long[] counts = loop(iterations, seed);
        big.join();
        long elapsed = System.nanoTime() - started;
        long gcs = collections() - gcsBefore;
        System.out.println("site smallArray " + counts[0] + " " + size[0]);
        System.out.println("site point " + counts[1] + " " + size[1]);
        System.out.println("site bigArray " + bigArrays + " " + size[2]);
        System.out.println("collections " + gcs);
        System.out.println("loop_ns " + elapsed);
        System.out.flush();
    }
}
