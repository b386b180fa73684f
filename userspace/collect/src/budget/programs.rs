//! What the budget remembers of programs: the highest cost measured of a process of
//! each program (its executable and build id) within the last [`HEAVY_MEMORY_NS`]. A
//! process of a program measured over its budget lately (a build's next `cc1` or `as`,
//! light in its first milliseconds) is not given links of its own; one of a program
//! not known so (a bystander, a batch job) is, at the first budget check after its
//! exec (docs/design.md, "Overhead budget").

use std::{collections::HashMap, ffi::OsString};

/// Programs remembered at most; beyond, the one measured longest ago goes.
const MAX_PROGRAMS: usize = 4096;

/// A program's highest cost stands this long after it was measured: a lower one
/// replaces it only then (a program's processes are light at their start, some of
/// them heavy later).
pub const HEAVY_MEMORY_NS: u64 = 60_000_000_000;

/// A program: its executable as the process names it and its build id. Hostile names
/// are only compared, never opened.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ProgramKey {
    /// `/proc/PID/exe` (empty if unreadable).
    pub exe: OsString,
    /// Its GNU build id, hex (empty if none).
    pub build_id: String,
}

/// The highest full-time cost measured lately of each program. See the module docs.
#[derive(Debug, Default)]
pub struct ProgramCosts {
    /// Per program: its cost (fraction of a CPU, full time) and when it was measured.
    costs: HashMap<ProgramKey, (f64, u64)>,
}

impl ProgramCosts {
    /// A process of `program` was measured at `full_time_cpu` at `now_ns`: kept if it
    /// is the highest within [`HEAVY_MEMORY_NS`].
    pub fn measured(&mut self, program: ProgramKey, full_time_cpu: f64, now_ns: u64) {
        if let Some(&(cost, at)) = self.costs.get(&program) {
            if cost > full_time_cpu && now_ns.saturating_sub(at) < HEAVY_MEMORY_NS {
                return;
            }
        }
        if self.costs.len() >= MAX_PROGRAMS && !self.costs.contains_key(&program) {
            let oldest = self
                .costs
                .iter()
                .min_by_key(|(_, &(_, at))| at)
                .map(|(key, _)| key.clone());
            if let Some(oldest) = oldest {
                self.costs.remove(&oldest);
            }
        }
        self.costs.insert(program, (full_time_cpu, now_ns));
    }

    /// True if a process of `program` measured more than `budget` within
    /// [`HEAVY_MEMORY_NS`] before `now_ns`.
    pub fn known_heavy(&self, program: &ProgramKey, budget: f64, now_ns: u64) -> bool {
        self.costs
            .get(program)
            .is_some_and(|&(cost, at)| cost > budget && now_ns.saturating_sub(at) < HEAVY_MEMORY_NS)
    }

    /// Programs remembered.
    pub fn len(&self) -> usize {
        self.costs.len()
    }

    /// True if none is.
    pub fn is_empty(&self) -> bool {
        self.costs.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn program(name: &str) -> ProgramKey {
        ProgramKey {
            exe: name.into(),
            build_id: String::new(),
        }
    }

    /// A program measured heavy stays so for a minute, whatever lighter measures come
    /// meanwhile (a process light at its start); then the last measure says.
    #[test]
    fn a_program_measured_heavy_lately_is_heavy() {
        const S: u64 = 1_000_000_000;
        let mut costs = ProgramCosts::default();
        let cc1 = program("/usr/libexec/gcc/x86_64-linux-gnu/12/cc1");
        assert!(!costs.known_heavy(&cc1, 0.01, 0));
        costs.measured(cc1.clone(), 0.8, S);
        assert!(costs.known_heavy(&cc1, 0.01, S));
        assert!(!costs.known_heavy(&program("/usr/bin/as"), 0.01, S));
        costs.measured(cc1.clone(), 0.002, 2 * S);
        assert!(costs.known_heavy(&cc1, 0.01, 2 * S));
        assert!(!costs.known_heavy(&cc1, 0.01, 61 * S), "a minute on");
        costs.measured(cc1.clone(), 0.002, 62 * S);
        assert!(!costs.known_heavy(&cc1, 0.01, 62 * S));
    }

    #[test]
    fn programs_remembered_are_bounded() {
        let mut costs = ProgramCosts::default();
        for i in 0..(MAX_PROGRAMS + 10) {
            costs.measured(program(&i.to_string()), 1.0, i as u64);
        }
        assert_eq!(costs.len(), MAX_PROGRAMS);
        let now = (MAX_PROGRAMS + 9) as u64;
        assert!(!costs.known_heavy(&program("0"), 0.01, now));
        assert!(costs.known_heavy(&program(&(MAX_PROGRAMS + 9).to_string()), 0.01, now));
    }
}
