//! What the budget reads of a tracked process: the program it runs (to remember its
//! cost by program) and its pace meter (docs/statistics.md, "Pace"). Here rather than
//! with the own links or the window moves that also read them, so that neither those
//! modules nor the budget's check import each other.

use allocbpf_probe::sampler::monotonic_now_ns;
use allocbpf_profile::estimate::pace::ProbeState;

use crate::{
    budget::{
        pace::{process_cpu_ns, PaceReading},
        programs::ProgramKey,
        HitCost, Hits,
    },
    engine::{ImageSet, Tracked},
};

/// The program `tracked` runs, as the budget remembers programs.
pub(in crate::engine) fn program_of(tracked: &Tracked) -> ProgramKey {
    ProgramKey {
        exe: tracked.info.exe.clone().into_os_string(),
        build_id: tracked.info.exe_build_id.clone(),
    }
}

/// One reading of `pid`'s pace meter: its CPU clock now and its `hits`, in `state` from
/// now on if given, else probed if every image it maps that can be probed has its
/// probes in (as in its observation windows), unprobed if none has and none is closing
/// its links in the background, changing otherwise.
pub(in crate::engine) fn read_pace(
    cost: &HitCost,
    pid: u32,
    tracked: &mut Tracked,
    hits: Hits,
    images: &ImageSet,
    state: Option<ProbeState>,
) {
    // Its own links are in whatever the shared ones do.
    let state = match tracked.own.attached() {
        true => Some(ProbeState::Probed),
        false => state,
    };
    let state = state.unwrap_or_else(|| {
        let probeable: Vec<_> = tracked
            .images
            .iter()
            .filter_map(|key| Some((key, images.images.get(key).filter(|s| !s.failed)?)))
            .collect();
        let probed = probeable.iter().filter(|(_, s)| s.links.is_some()).count();
        let closing = probeable.iter().any(|(key, _)| images.detaching(key));
        match (probed, closing) {
            // No image known (just exec'd): its probes may be in or out.
            _ if probeable.is_empty() => ProbeState::Changing,
            (0, false) => ProbeState::Unprobed,
            (n, false) if n == probeable.len() => ProbeState::Probed,
            _ => ProbeState::Changing,
        }
    });
    let reading = process_cpu_ns(pid).map(|cpu_ns| PaceReading {
        at_ns: monotonic_now_ns(),
        cpu_ns,
        hits,
        state,
    });
    tracked.pace.read(reading, cost);
}
