//! The finished profile every exporter reads: symbolized stacks with estimates, and the
//! exact totals the kernel counted.

use std::time::Duration;

use crate::{
    aggregate::{Aggregate, StackStats},
    estimate::{Confidence, Interval, IntervalInputs},
    normalize::{Frame, Module, ModuleTable},
    probe::Counters,
    symbolize::{FrameSymbolizer, Functions},
};

/// A symbolized frame.
#[derive(Clone, Debug)]
pub struct Location {
    /// The normalized address.
    pub frame: Frame,
    /// Functions at that address, innermost first.
    pub functions: Functions,
}

/// One (process, stack) with its estimates.
#[derive(Clone, Debug)]
pub struct StackReport {
    /// Process id.
    pub pid: u32,
    /// Locations, innermost (the allocation's caller) first.
    pub locations: Vec<Location>,
    /// Raw samples, estimated bytes and objects.
    pub stats: StackStats,
}

impl StackReport {
    /// Function names, outermost first (inlined frames included).
    pub fn function_names(&self) -> Vec<&str> {
        self.locations
            .iter()
            .rev()
            .flat_map(|l| l.functions.iter().rev().map(|f| f.name.as_str()))
            .collect()
    }
}

/// Exact figures counted in the kernel, and sampling health.
#[derive(Clone, Copy, Debug, Default)]
pub struct Totals {
    /// Exact bytes requested through the probed functions.
    pub exact_bytes: u64,
    /// Exact number of calls.
    pub exact_calls: u64,
    /// Sum of all sample weights.
    pub estimated_bytes: f64,
    /// Samples received.
    pub samples: u64,
    /// Samples lost (ring buffer full).
    pub drops: u64,
    /// What the interval on `estimated_bytes` needs.
    pub interval_inputs: IntervalInputs,
}

/// What the kernel side reported at the end of a session.
#[derive(Clone, Copy, Debug, Default)]
pub struct KernelFigures {
    /// How long profiling ran.
    pub duration: Duration,
    /// Exact totals of the profiled process.
    pub exact: allocbpf_common::Totals,
    /// Kernel counters.
    pub counters: Counters,
}

/// A finished profile.
#[derive(Clone, Debug)]
pub struct Report {
    /// Mean sampling interval in bytes.
    pub rate: u64,
    /// Level of the confidence intervals shown.
    pub confidence: Confidence,
    /// How long profiling ran.
    pub duration: Duration,
    /// Exact and estimated totals.
    pub totals: Totals,
    /// Kernel counters.
    pub counters: Counters,
    /// Modules frames point into, indexed by [`Frame::Module::module`].
    pub modules: Vec<Module>,
    /// Stacks, largest estimated bytes first.
    pub stacks: Vec<StackReport>,
}

impl Report {
    /// Symbolizes an aggregate into a report.
    pub fn build(
        aggregate: &Aggregate,
        modules: &ModuleTable,
        symbolizer: &mut FrameSymbolizer,
        rate: u64,
        confidence: Confidence,
        kernel: KernelFigures,
    ) -> Report {
        let KernelFigures {
            duration,
            exact,
            counters,
        } = kernel;
        symbolizer.prepare(
            modules,
            aggregate.stacks().flat_map(|(k, _)| k.frames.iter()),
        );
        let mut stacks: Vec<StackReport> = aggregate
            .stacks()
            .map(|(key, stats)| StackReport {
                pid: key.pid,
                locations: key
                    .frames
                    .iter()
                    .map(|frame| Location {
                        frame: *frame,
                        functions: symbolizer.functions(frame),
                    })
                    .collect(),
                stats: *stats,
            })
            .collect();
        stacks.sort_by(|a, b| b.stats.estimated_bytes.total_cmp(&a.stats.estimated_bytes));
        Report {
            rate,
            confidence,
            duration,
            totals: Totals {
                exact_bytes: exact.bytes,
                exact_calls: exact.calls,
                estimated_bytes: aggregate.totals.estimated_bytes,
                samples: aggregate.totals.samples,
                drops: counters.ring_buffer_drops,
                interval_inputs: aggregate.totals.interval_inputs,
            },
            counters,
            modules: modules.all().to_vec(),
            stacks,
        }
    }

    /// The interval on a stack's estimated bytes at the report's level.
    pub fn interval(&self, stats: &StackStats) -> Interval {
        stats.bytes_interval(self.rate, self.confidence)
    }

    /// The interval on the total estimated bytes at the report's level.
    pub fn total_interval(&self) -> Interval {
        self.totals
            .interval_inputs
            .interval(self.rate, self.confidence)
    }

    /// Stacks merged by (pid, function names): what people read. Largest first.
    pub fn stacks_by_name(&self) -> Vec<(u32, Vec<&str>, StackStats)> {
        let mut merged: Vec<(u32, Vec<&str>, StackStats)> = Vec::new();
        let mut index = std::collections::HashMap::new();
        for stack in &self.stacks {
            let names = stack.function_names();
            let key = (stack.pid, names.clone());
            match index.get(&key) {
                Some(&i) => {
                    let entry: &mut (u32, Vec<&str>, StackStats) = &mut merged[i];
                    entry.2.merge(&stack.stats);
                }
                None => {
                    index.insert(key, merged.len());
                    merged.push((stack.pid, names, stack.stats));
                }
            }
        }
        merged.sort_by(|a, b| b.2.estimated_bytes.total_cmp(&a.2.estimated_bytes));
        merged
    }
}
