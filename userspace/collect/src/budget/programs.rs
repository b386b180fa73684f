//! What the budget remembers of programs: the last cost measured of a process of each
//! program (its executable and build id). A new process of a program known to be over
//! its budget (a build's next `cc1`) is not given links of its own before it is
//! measured; one of a program not known so (a bystander, a batch job) is, at the first
//! budget check after its exec (docs/design.md, "Overhead budget").

use std::{collections::HashMap, ffi::OsString};

/// Programs remembered at most; beyond, the one measured longest ago goes.
const MAX_PROGRAMS: usize = 4096;

/// A program: its executable as the process names it and its build id. Hostile names
/// are only compared, never opened.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ProgramKey {
    /// `/proc/PID/exe` (empty if unreadable).
    pub exe: OsString,
    /// Its GNU build id, hex (empty if none).
    pub build_id: String,
}

/// The last full-time cost measured of each program. See the module docs.
#[derive(Debug, Default)]
pub struct ProgramCosts {
    /// Per program: its cost (fraction of a CPU, full time) and when it was measured.
    costs: HashMap<ProgramKey, (f64, u64)>,
}

impl ProgramCosts {
    /// A process of `program` was measured at `full_time_cpu` at `now_ns`.
    pub fn measured(&mut self, program: ProgramKey, full_time_cpu: f64, now_ns: u64) {
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

    /// True if the last process of `program` measured cost more than `budget`.
    pub fn known_heavy(&self, program: &ProgramKey, budget: f64) -> bool {
        self.costs
            .get(program)
            .is_some_and(|&(cost, _)| cost > budget)
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

    #[test]
    fn the_last_measure_of_a_program_says_whether_it_is_heavy() {
        let mut costs = ProgramCosts::default();
        let cc1 = program("/usr/libexec/gcc/x86_64-linux-gnu/12/cc1");
        assert!(!costs.known_heavy(&cc1, 0.01));
        costs.measured(cc1.clone(), 0.8, 1);
        assert!(costs.known_heavy(&cc1, 0.01));
        assert!(!costs.known_heavy(&program("/usr/bin/as"), 0.01));
        costs.measured(cc1.clone(), 0.002, 2);
        assert!(!costs.known_heavy(&cc1, 0.01));
    }

    #[test]
    fn programs_remembered_are_bounded() {
        let mut costs = ProgramCosts::default();
        for i in 0..(MAX_PROGRAMS + 10) {
            costs.measured(program(&i.to_string()), 1.0, i as u64);
        }
        assert_eq!(costs.len(), MAX_PROGRAMS);
        assert!(!costs.known_heavy(&program("0"), 0.01));
        assert!(costs.known_heavy(&program(&(MAX_PROGRAMS + 9).to_string()), 0.01));
    }
}
