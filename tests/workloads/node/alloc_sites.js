// A Node.js workload with known allocation sites, for allocbpf's Node.js tests (the
// workload protocol: prints its pid, waits for "go" on stdin, allocates, prints its
// truth, exits).
//
// The loop runs the sites in blocks of BLOCK objects, the site of each block picked at
// random (a fixed seed), so that the allocation that ends a linear allocation buffer's
// chunk is a random one, with probability proportional to its bytes: the Node.js
// estimator's premise (docs/statistics.md, "Node.js"). A block is far smaller than a
// chunk. Every value the loop computes is a small integer (no heap number), and every
// object it makes escapes into a ring (the JIT cannot remove it). The sites are called
// through one call site that has seen five functions (megamorphic): the JIT inlines
// none of them, so that each keeps a frame of its own (V8 keeps the positions of
// inlined functions only while its own profiler or debugger runs).
//
// Sites:
//   pointA     objects of four small integers, three times as many blocks as
//   pointB     objects of the same shape and size;
//   bigArray   arrays of 20000 holes: their 160 KB of elements go to V8's large-object
//              space, one block in BIG_EVERY;
//   buffer     Buffers of 8 KiB: their bytes are malloc'd (native), their JS objects
//              are on the JS heap, one block in BUFFER_EVERY;
//   spare      objects of the same shape, only while warming up (the fifth function).
//
// Each site's JS heap bytes per object are measured, not assumed, with V8's own heap
// statistics (used heap size before and after making many), and the JS heap bytes
// the whole loop allocated with V8's own accounting too: the used heap size at its end
// less that at its start, plus what each garbage collection freed (v8.GCProfiler).
// Prints `site NAME COUNT BYTES_EACH` per site, `allocated BYTES`, `collections N`
// and `loop_ns NS` (what the benchmark times).
//
// Usage: node alloc_sites.js BLOCKS SEED
'use strict';
const v8 = require('v8');

const BLOCK = 64;
const BIG_EVERY = 97;
const BUFFER_EVERY = 89;
const RING = 4096;
const ring = new Array(RING).fill(null);
let next = 0;

function pointA(n) {
  for (let k = 0; k < n; k++) {
    ring[next++ & (RING - 1)] = { a: k, b: k, c: k, d: k };
  }
}

function pointB(n) {
  for (let k = 0; k < n; k++) {
    ring[next++ & (RING - 1)] = { a: k, b: k, c: k, d: k };
  }
}

function bigArray(n) {
  for (let k = 0; k < n; k++) {
    ring[next++ & (RING - 1)] = new Array(20000);
  }
}

function buffer(n) {
  for (let k = 0; k < n; k++) {
    ring[next++ & (RING - 1)] = Buffer.alloc(8192);
  }
}

function spare(n) {
  for (let k = 0; k < n; k++) {
    ring[next++ & (RING - 1)] = { a: k, b: k, c: k, d: k };
  }
}

const SITES = [pointA, pointB, bigArray, buffer, spare];

// Site of block `b` from the generator's state `s`: 0 pointA, 1 pointB (3:1),
// 2 bigArray, 3 buffer.
function siteOf(s, b) {
  if (b % BIG_EVERY === BIG_EVERY - 1) return 2;
  if (b % BUFFER_EVERY === BUFFER_EVERY - 1) return 3;
  return (s & 3) === 0 ? 1 : 0;
}

// Runs `blocks` blocks; returns the objects each site made.
function loop(blocks, seed, warming) {
  const counts = [0, 0, 0, 0, 0];
  let s = seed & 0x7fffffff;
  for (let b = 0; b < blocks; b++) {
    s = (Math.imul(s, 1103515245) + 12345) & 0x7fffffff;
    const site = warming && b % 5 === 4 ? 4 : siteOf(s >>> 16, b);
    const n = site === 2 || site === 3 ? 1 : BLOCK;
    counts[site] += n;
    SITES[site](n);
  }
  return counts;
}

function used() {
  return v8.getHeapStatistics().used_heap_size;
}

// JS heap bytes one object of `site` takes, V8's objects being whole words: the
// used heap's growth while making `n` of them, less that of a round making none (what
// reading the statistics allocates), per object and rounded to words, the most
// frequent over rounds (a round a collection ran in, or one still in the interpreter,
// which allocates more, is off).
function bytesPerObject(site) {
  const n = site === 2 || site === 3 ? 4 : 1000;
  let baseline = Infinity;
  for (let r = 0; r < 5; r++) {
    const before = used();
    baseline = Math.min(baseline, used() - before);
  }
  const seen = new Map();
  for (let r = 0; r < 41; r++) {
    const before = used();
    SITES[site](n);
    const each = Math.round((used() - before - baseline) / n / 8) * 8;
    seen.set(each, (seen.get(each) || 0) + 1);
  }
  let best = 0;
  let times = 0;
  for (const [each, count] of seen) {
    if (count > times) [best, times] = [each, count];
  }
  return best;
}

const blocks = Number(process.argv[2]);
const seed = Number(process.argv[3]);
// Warm up: the loop and its sites compiled (the call site megamorphic) before
// profiling starts.
loop(Math.min(blocks, 50000), seed + 1, true);
const size = [0, 1, 2, 3].map(bytesPerObject);

process.stdout.write(`${process.pid}\n`);

process.stdin.once('data', () => {
  process.stdin.pause();
  const profiler = new v8.GCProfiler();
  profiler.start();
  const start = used();
  const started = process.hrtime.bigint();
  const counts = loop(blocks, seed, false);
  const elapsed = process.hrtime.bigint() - started;
  const end = used();
  const stats = profiler.stop().statistics;
  let freed = 0;
  for (const gc of stats) {
    freed += gc.beforeGC.heapStatistics.usedHeapSize - gc.afterGC.heapStatistics.usedHeapSize;
  }
  const names = ['pointA', 'pointB', 'bigArray', 'buffer'];
  let out = '';
  for (let k = 0; k < 4; k++) out += `site ${names[k]} ${counts[k]} ${size[k]}\n`;
  out += `allocated ${end - start + freed}\n`;
  out += `collections ${stats.length}\n`;
  out += `loop_ns ${elapsed}\n`;
  // Exits once the truth is out (stdin, though paused, would keep the process on).
  process.stdout.write(out, () => process.exit(0));
});
