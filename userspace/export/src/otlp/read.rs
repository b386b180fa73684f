//! Reading a request back through its dictionary: totals per sample type and stacks
//! by function name. Indices out of their tables read as the zero entry (index 0):
//! a malformed request gives odd answers, not a panic.

use super::proto::{
    ExportProfilesServiceRequest, Function, Location, Profile, ProfilesDictionary, Sample, Stack,
};

/// The entry `i` of `table`, or `zero` if `i` is out of it.
fn entry<'a, T>(table: &'a [T], i: i32, zero: &'a T) -> &'a T {
    usize::try_from(i)
        .ok()
        .and_then(|i| table.get(i))
        .unwrap_or(zero)
}

/// String `i` of the dictionary, or "".
fn string(dict: &ProfilesDictionary, i: i32) -> &str {
    usize::try_from(i)
        .ok()
        .and_then(|i| dict.string_table.get(i))
        .map_or("", String::as_str)
}

/// Every profile of the request, with its sample type's name and unit.
fn profiles<'a>(
    request: &'a ExportProfilesServiceRequest,
    dict: &'a ProfilesDictionary,
) -> impl Iterator<Item = (&'a str, &'a str, &'a Profile)> {
    request
        .resource_profiles
        .iter()
        .flat_map(|r| &r.scope_profiles)
        .flat_map(|s| &s.profiles)
        .map(move |p| {
            let t = p.sample_type.clone().unwrap_or_default();
            (
                string(dict, t.type_strindex),
                string(dict, t.unit_strindex),
                p,
            )
        })
}

/// A sample's total: the sum of its values, or with timestamps only, their count
/// (the proto's "timestamps only" shape counts 1 per timestamp).
fn sample_total(sample: &Sample) -> i64 {
    if sample.values.is_empty() {
        return sample.timestamps_unix_nano.len() as i64;
    }
    sample
        .values
        .iter()
        .fold(0i64, |sum, v| sum.saturating_add(*v))
}

/// The sum of every sample's values per sample type `(type, unit, total)`, in the
/// order types first appear; profiles of one type (from several resources) add up.
pub fn totals_by_type(request: &ExportProfilesServiceRequest) -> Vec<(String, String, i64)> {
    let empty = ProfilesDictionary::default();
    let dict = request.dictionary.as_ref().unwrap_or(&empty);
    let mut totals: Vec<(String, String, i64)> = Vec::new();
    for (t, unit, profile) in profiles(request, dict) {
        let sum = profile
            .samples
            .iter()
            .fold(0i64, |sum, s| sum.saturating_add(sample_total(s)));
        match totals.iter_mut().find(|(tt, uu, _)| tt == t && uu == unit) {
            Some(total) => total.2 = total.2.saturating_add(sum),
            None => totals.push((t.to_string(), unit.to_string(), sum)),
        }
    }
    totals
}

/// The stacks of the profiles of sample type `sample_type`, as function names leaf
/// first (a location's inlined functions innermost first, as in pprof), each with its
/// total; samples with the same names (differing in attributes) are added up, in the
/// order stacks first appear. A location without functions is named by its address
/// (`0x1234`); a function without a name by its system name.
pub fn stacks(
    request: &ExportProfilesServiceRequest,
    sample_type: &str,
) -> Vec<(Vec<String>, i64)> {
    let empty = ProfilesDictionary::default();
    let dict = request.dictionary.as_ref().unwrap_or(&empty);
    let mut out: Vec<(Vec<String>, i64)> = Vec::new();
    for (_, _, profile) in profiles(request, dict).filter(|(t, _, _)| *t == sample_type) {
        for sample in &profile.samples {
            let names = names(dict, sample.stack_index);
            let total = sample_total(sample);
            match out.iter_mut().find(|(n, _)| *n == names) {
                Some(entry) => entry.1 = entry.1.saturating_add(total),
                None => out.push((names, total)),
            }
        }
    }
    out
}

/// The function names of stack `stack_index`, leaf first.
fn names(dict: &ProfilesDictionary, stack_index: i32) -> Vec<String> {
    let (zero_stack, zero_location, zero_function) =
        (Stack::default(), Location::default(), Function::default());
    let stack = entry(&dict.stack_table, stack_index, &zero_stack);
    let mut names = Vec::new();
    for &l in &stack.location_indices {
        let location = entry(&dict.location_table, l, &zero_location);
        if location.lines.is_empty() {
            names.push(format!("{:#x}", location.address));
        }
        for line in &location.lines {
            let f = entry(&dict.function_table, line.function_index, &zero_function);
            let name = match string(dict, f.name_strindex) {
                "" => string(dict, f.system_name_strindex),
                name => name,
            };
            names.push(name.to_string());
        }
    }
    names
}
