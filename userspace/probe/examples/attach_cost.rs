//! What attaching and detaching one allocator image's probes costs while N processes
//! map the image: the kernel installs (and removes) a breakpoint in every mapping of
//! the file, so the cost grows with N. A design that attaches images for windows of
//! time (the overhead budget) pays this at each window's edges.
//!
//! Attaching grows with the processes that map the image; detaching with the probes,
//! each waiting for a grace period, whatever the count: detaching is the costly edge,
//! in wall time on the thread that does it. The figures measured are in
//! docs/benchmarks.md.
//!
//! With `--multi`, the probes are uprobe_multi links (what the overhead budget's
//! windows use): one link per program, each closed on a thread of its own, and the
//! detach time is until every close has returned (the breakpoints go at each close's
//! start; the close then waits for one grace period).
//!
//! Run as root, after `cargo build --release` has built the eBPF object:
//! `cargo run --release -p allocbpf-probe --example attach_cost -- 0 100 1000`
//! (the numbers are how many extra processes map libc; `sleep` processes, started and
//! killed here). The object is read from `ALLOCBPF_BPF_OBJECT`, by default where the
//! binary's `build.rs` builds it ([`DEFAULT_OBJECT`]). The empty program is attached at allocbpf's probe points, so nothing
//! is sampled meanwhile.

use std::{
    error::Error,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use allocbpf_images::{image::Lookup, target::Target};
use allocbpf_probe::sampler::{Sampler, SamplerConfig, ThreadTables};

/// Where `userspace/allocbpf/build.rs` builds the eBPF object, from the workspace root.
const DEFAULT_OBJECT: &str = "target/bpf/bpfel-unknown-none/release/allocbpf";

/// Attach/detach pairs timed per process count (medians are printed).
const ROUNDS: usize = 7;

fn main() -> Result<(), Box<dyn Error>> {
    let multi = std::env::args().any(|a| a == "--multi");
    // `--own`: the links filter on this process (the per-process links a light process
    // gets beside a heavy one on a shared image), so breakpoints go into one mapping.
    let own = std::env::args().any(|a| a == "--own");
    let counts: Vec<usize> = std::env::args()
        .skip(1)
        .filter(|a| a != "--multi" && a != "--own")
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    let counts = if counts.is_empty() {
        vec![0, 100, 1000]
    } else {
        counts
    };
    // Our own libc is the host's: the image every process maps.
    let target = Target::resolve(std::process::id(), &Lookup::default())?;
    let image = target
        .images
        .iter()
        .find(|image| image.families.contains(&"glibc"))
        .or(target.images.first())
        .ok_or("no allocator image in this process")?;
    let object_path =
        std::env::var("ALLOCBPF_BPF_OBJECT").unwrap_or_else(|_| DEFAULT_OBJECT.to_string());
    // A fresh heap buffer: aligned as the ELF parser wants it.
    let object = std::fs::read(&object_path).map_err(|e| {
        format!("{object_path}: {e} (build the binary first, or set ALLOCBPF_BPF_OBJECT)")
    })?;
    let mut sampler = Sampler::load(
        &object,
        SamplerConfig {
            pid: own.then(std::process::id),
            rate: 512 << 10,
            empty_probes: true,
            thread_tables: ThreadTables::default(),
            live: None,
            stack_copy_bytes: 0,
            count_hits: false,
            multi_links: multi,
        },
    )?;
    println!(
        "attach/detach of {} ({} entries), empty program, {}, median of {ROUNDS}:",
        image.path_in_target.display(),
        image.entries.len(),
        if multi && own {
            "uprobe_multi links of this process only, closed in parallel"
        } else if multi {
            "uprobe_multi links closed in parallel"
        } else {
            "one perf-event uprobe per entry"
        }
    );
    println!(
        "{:>10} {:>12} {:>12} {:>22}",
        "processes", "attach ms", "detach ms", "attach us/process"
    );
    // The first count's figures, to state the cost of each process more.
    let mut first: Option<(usize, Duration)> = None;
    for count in counts {
        let mut children = spawn_sleepers(count)?;
        // Let each sleeper's loader map libc before timing.
        thread::sleep(Duration::from_millis(300 + count as u64));
        let (attach, detach) = time_rounds(&mut sampler, image, multi)?;
        for child in &mut children {
            let _ = child.kill();
        }
        for child in &mut children {
            let _ = child.wait();
        }
        // Marginal: what attaching costs for each process more than the first row's
        // (detaching is dominated by a fixed wait per probe, see the module docs).
        let per_process = match first {
            Some((base_count, base)) if count > base_count => format!(
                "{:.1}",
                (attach.as_secs_f64() - base.as_secs_f64()) * 1e6 / (count - base_count) as f64
            ),
            _ => "-".to_string(),
        };
        first.get_or_insert((count, attach));
        println!(
            "{:>10} {:>12.3} {:>12.3} {:>22}",
            count + 1,
            attach.as_secs_f64() * 1e3,
            detach.as_secs_f64() * 1e3,
            per_process
        );
    }
    Ok(())
}

/// Attaches and detaches `image`'s probes [`ROUNDS`] times: the median attach and
/// detach times (`multi`: uprobe_multi links, closed on a thread each).
fn time_rounds(
    sampler: &mut Sampler,
    image: &allocbpf_images::image::AllocatorImage,
    multi: bool,
) -> Result<(Duration, Duration), Box<dyn Error>> {
    let (mut attach, mut detach) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let started = Instant::now();
        let attached = sampler.attach(image)?;
        let attached_at = Instant::now();
        if multi {
            let closes: Vec<_> = sampler
                .take_links(attached.links)
                .split()
                .into_iter()
                .map(|link| thread::spawn(move || drop(link)))
                .collect();
            for close in closes {
                let _ = close.join();
            }
        } else {
            sampler.detach(attached.links);
        }
        attach.push(attached_at.duration_since(started));
        detach.push(attached_at.elapsed());
    }
    Ok((median(attach), median(detach)))
}

fn spawn_sleepers(count: usize) -> std::io::Result<Vec<Child>> {
    (0..count)
        .map(|_| {
            Command::new("sleep")
                .arg("600")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
        })
        .collect()
}

fn median(values: Vec<Duration>) -> Duration {
    let seconds: Vec<f64> = values.iter().map(Duration::as_secs_f64).collect();
    Duration::from_secs_f64(allocbpf_profile::estimate::median(&seconds))
}
