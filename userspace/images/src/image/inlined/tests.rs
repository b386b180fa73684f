use super::*;

/// Debian's python3.11 `PyObject_Malloc` (non-PIE): the comparison with
/// `_PyObject_Malloc` at 0x4fb450 and `usedpools` at 0x959d20.
#[test]
fn markers_from_a_non_pie_entry() {
    let code = [
        0x53, // push %rbx
        0x48, 0x85, 0xff, // test %rdi,%rdi
        0x48, 0x8b, 0x05, 0xe7, 0xeb, 0x45, 0x00, // mov 0x45ebe7(%rip),%rax
        0x48, 0x89, 0xfb, // mov %rdi,%rbx
        0x48, 0x3d, 0x50, 0xb4, 0x4f, 0x00, // cmp $0x4fb450,%rax
        0x75, 0x10, // jne
        0x8d, 0x7b, 0xff, // lea -0x1(%rbx),%edi
        0xc1, 0xef, 0x04, // shr $0x4,%edi
        0x8d, 0x04, 0x3f, // lea (%rdi,%rdi,1),%eax
        0x48, 0x8b, 0x14, 0xc5, 0x20, 0x9d, 0x95, 0x00, // mov 0x959d20(,%rax,8),%rdx
    ];
    let markers = markers(&code, 0x4fb350).unwrap();
    assert_eq!(
        markers,
        Markers {
            default_allocator: 0x4fb450,
            usedpools: Usedpools::At(0x959d20)
        }
    );
}

/// A position-independent entry compares with a register a `lea` loaded, and
/// indexes `usedpools` through another.
#[test]
fn markers_from_a_pie_entry() {
    let code = [
        0x48, 0x8d, 0x15, 0x00, 0x10, 0x00, 0x00, // lea 0x1000(%rip),%rdx
        0x48, 0x39, 0xd0, // cmp %rdx,%rax
        0x75, 0x10, // jne
        0x48, 0x8d, 0x0d, 0x00, 0x20, 0x00, 0x00, // lea 0x2000(%rip),%rcx
        0x48, 0x8b, 0x14, 0xc1, // mov (%rcx,%rax,8),%rdx
    ];
    let markers = markers(&code, 0x1000).unwrap();
    assert_eq!(markers.default_allocator, 0x1000 + 7 + 0x1000);
    assert_eq!(markers.usedpools, Usedpools::At(0x100c + 7 + 0x2000));
}

/// A `PyObject_Malloc` that only calls through the pointer (no link-time
/// optimisation) has no markers, hence no sites.
#[test]
fn no_markers_without_the_inlined_comparison() {
    let code = [
        0x48, 0x8b, 0x05, 0x00, 0x10, 0x00, 0x00, // mov 0x1000(%rip),%rax
        0x48, 0x89, 0xfe, // mov %rdi,%rsi
        0x48, 0x8b, 0x3d, 0x00, 0x10, 0x00, 0x00, // mov 0x1000(%rip),%rdi
        0xff, 0xe0, // jmp *%rax
    ];
    assert_eq!(markers(&code, 0x1000), None);
}

/// The size of the inlined path `code` at 0x4fb000 (3.11's markers).
fn size(code: &[u8]) -> Option<(Reg, u64)> {
    size_of_path(code, 0x4fb000, 0x4fb000, Usedpools::At(0x959d20))
}

/// `mov` of the word at `address` (rip-relative) into %rax, at 0x4fb000.
fn load_at(address: u64) -> Vec<u8> {
    let disp = (address - (0x4fb000 + 7)) as u32;
    let mut mov = vec![0x48, 0x8b, 0x05];
    mov.extend_from_slice(&disp.to_le_bytes());
    mov
}

/// The three starts of an inlined path, and ones that tell nothing.
#[test]
fn sizes_of_inlined_paths() {
    // lea -0x1(%r13),%rax
    assert_eq!(size(&[0x49, 0x8d, 0x45, 0xff]), Some((Reg::R13, 1)));
    // cmp $0x200,%r12
    assert_eq!(
        size(&[0x49, 0x81, 0xfc, 0x00, 0x02, 0x00, 0x00]),
        Some((Reg::R12, 1))
    );
    // mov 0x959d90(%rip),%rax: usedpools + 0x70, class 7: 128 bytes.
    assert_eq!(size(&load_at(0x959d90)), Some((Reg::One, 128)));
    // Misaligned in usedpools, or past it: nothing.
    assert_eq!(size(&load_at(0x959d98)), None);
    assert_eq!(size(&load_at(0x959d20 + 1024)), None);
    // mov %rdi,%rbx, then ret: nothing.
    assert_eq!(size(&[0x48, 0x89, 0xfb, 0xc3]), None);
    // lea -0x1(%rsp),%rax: not a size.
    assert_eq!(size(&[0x48, 0x8d, 0x44, 0x24, 0xff]), None);
    // mov %rax,%r13, then lea -0x1(%r13),%rax: %r13 no longer holds the size.
    assert_eq!(size(&[0x49, 0x89, 0xc5, 0x49, 0x8d, 0x45, 0xff]), None);
}

/// 3.13: the state's pointer is loaded first (`mov 0x2a30(%rax),%r12`), then
/// either the size is used, or a constant class's entry is loaded from the state.
#[test]
fn sizes_of_inlined_paths_with_the_state_in_a_register() {
    let usedpools = Usedpools::InState {
        state: 0x2a30,
        usedpools: 0,
    };
    let state_load = [
        0x48, 0x8b, 0x40, 0x10, // mov 0x10(%rax),%rax
        0x4c, 0x8b, 0xa0, 0x30, 0x2a, 0x00, 0x00, // mov 0x2a30(%rax),%r12
    ];
    // then mov 0x10(%r12),%rax: class 1, 32 bytes.
    let mut constant = state_load.to_vec();
    constant.extend_from_slice(&[0x49, 0x8b, 0x44, 0x24, 0x10]);
    assert_eq!(
        size_of_path(&constant, 0x1000, 0x1000, usedpools),
        Some((Reg::One, 32))
    );
    // then lea -0x1(%rdi),%rax: the size in %rdi.
    let mut sized = state_load.to_vec();
    sized.extend_from_slice(&[0x48, 0x8d, 0x47, 0xff]);
    assert_eq!(
        size_of_path(&sized, 0x1000, 0x1000, usedpools),
        Some((Reg::Rdi, 1))
    );
    // mov 0x10(%rax),%rax alone is no state load: nothing.
    assert_eq!(
        size_of_path(&state_load[..4], 0x1000, 0x1000, usedpools),
        None
    );
}

/// 3.13's constant sites that set their class's index first, for a tail several sites
/// share (`_PyLong_Add`): `mov $0x2,%eax; ...; mov (%rdx,%rax,8),%r10` is class 1, 32
/// bytes; and a path that jumps to its state load.
#[test]
fn constant_indices_and_jumps_on_inlined_paths() {
    let usedpools = Usedpools::InState {
        state: 0x2a30,
        usedpools: 0,
    };
    let indexed = [
        0xb8, 0x02, 0x00, 0x00, 0x00, // mov $0x2,%eax
        0xbe, 0x20, 0x00, 0x00, 0x00, // mov $0x20,%esi
        0x64, 0x48, 0x8b, 0x14, 0x25, 0xe8, 0xff, 0xff,
        0xff, // mov %fs:0xffffffffffffffe8,%rdx
        0x48, 0x8b, 0x52, 0x10, // mov 0x10(%rdx),%rdx
        0x48, 0x8b, 0x92, 0x30, 0x2a, 0x00, 0x00, // mov 0x2a30(%rdx),%rdx
        0x4c, 0x8b, 0x14, 0xc2, // mov (%rdx,%rax,8),%r10
    ];
    assert_eq!(
        size_of_path(&indexed, 0x1000, 0x1000, usedpools),
        Some((Reg::One, 32))
    );
    // jmp +2 over a ud2, then the state load and class 0's entry.
    let jumped = [
        0xeb, 0x02, // jmp +2
        0x0f, 0x0b, // ud2
        0x48, 0x8b, 0x40, 0x10, // mov 0x10(%rax),%rax
        0x48, 0x8b, 0xa8, 0x30, 0x2a, 0x00, 0x00, // mov 0x2a30(%rax),%rbp
        0x48, 0x8b, 0x45, 0x00, // mov 0x0(%rbp),%rax
    ];
    assert_eq!(
        size_of_path(&jumped, 0x1000, 0x1000, usedpools),
        Some((Reg::One, 16))
    );
    // mov $0x1c,%r15d, then lea -0x1(%r15),%esi: the request is 28 bytes.
    let constant = [
        0x41, 0xbf, 0x1c, 0x00, 0x00, 0x00, // mov $0x1c,%r15d
        0x41, 0x8d, 0x77, 0xff, // lea -0x1(%r15),%esi
    ];
    assert_eq!(
        size_of_path(&constant, 0x1000, 0x1000, usedpools),
        Some((Reg::One, 28))
    );
    // mov $0x2a,%esi, then sub $0x1,%esi: 42 bytes.
    let subtracted = [
        0xbe, 0x2a, 0x00, 0x00, 0x00, // mov $0x2a,%esi
        0x83, 0xee, 0x01, // sub $0x1,%esi
    ];
    assert_eq!(
        size_of_path(&subtracted, 0x1000, 0x1000, usedpools),
        Some((Reg::One, 42))
    );
    // An index the path did not set: nothing.
    assert_eq!(size_of_path(&indexed[5..], 0x1000, 0x1000, usedpools), None);
}

/// Debian's python3.11, when this machine has it: well over a hundred sites, all
/// at emulated branches, none inside a probed entry.
#[test]
fn debian_python_has_inlined_sites() {
    let path = "/usr/bin/python3.11";
    let Ok(data) = std::fs::read(path) else {
        return;
    };
    let file = object::File::parse(&*data).unwrap();
    let resolved = super::super::resolve_entries(&file, &data, &Default::default()).unwrap();
    let found = find(&file, &resolved.entries, &resolved.frees);
    assert!(found.sites.len() > 100, "{} sites", found.sites.len());
    assert!(found.sites.iter().all(|s| s.point.emulated));
    for site in &found.sites {
        assert!(resolved
            .entries
            .iter()
            .all(|e| !(e.address..e.address + e.size).contains(&site.address)));
    }
    let constant: Vec<_> = found
        .sites
        .iter()
        .filter(|s| s.point.registers[0] == Reg::One)
        .collect();
    assert!(constant.len() > 10);
    // Most constant sites know their request exactly (not a multiple of 16).
    let exact = constant.iter().filter(|s| s.size % 16 != 0).count();
    println!("{exact} of {} constant sites exact", constant.len());
    // Its inlined frees: dozens, at emulated branches, none in a probed free entry,
    // each with its block in a register.
    assert!(found.frees.len() > 30, "{} frees", found.frees.len());
    assert!(found.frees.iter().all(|s| s.point.emulated));
    assert!(found.frees.iter().all(|s| s.point.registers[0] != Reg::One));
    for site in &found.frees {
        assert!(resolved
            .frees
            .iter()
            .all(|e| !(e.address..e.address + e.size).contains(&site.address)));
    }
    println!(
        "{} sites, {} frees, {} unrecognised",
        found.sites.len(),
        found.frees.len(),
        found.unrecognised
    );
}

/// Any interpreter named by `ALLOCBPF_PYTHON_IMAGE` (a manual check of other builds).
#[test]
fn sites_of_a_named_interpreter() {
    let Ok(path) = std::env::var("ALLOCBPF_PYTHON_IMAGE") else {
        return;
    };
    let data = std::fs::read(&path).unwrap();
    let file = object::File::parse(&*data).unwrap();
    let resolved = super::super::resolve_entries(&file, &data, &Default::default()).unwrap();
    let found = find(&file, &resolved.entries, &resolved.frees);
    println!(
        "{path}: {} sites, {} frees, {} unrecognised, usedpools {:?}",
        found.sites.len(),
        found.frees.len(),
        found.unrecognised,
        usedpools(&file)
    );
    for e in &found.frees {
        let register = e.point.registers[0];
        println!("free {:#x} +{} {register:?}", e.address, e.point.offset);
    }
}

/// The constant a hooked path passes in `%rsi` to the domain's allocator (Debian 3.11's
/// paths: directly, through `%rbp`, and after a jump).
#[test]
fn constant_requests_of_hooked_paths() {
    let direct = [
        0xbe, 0x78, 0x00, 0x00, 0x00, // mov $0x78,%esi
        0x41, 0xbe, 0x50, 0x00, 0x00, 0x00, // mov $0x50,%r14d
        0xff, 0xd0, // call *%rax
    ];
    assert_eq!(
        constant_request(&direct, 0x1000, &direct, 0x1000),
        Some(0x78)
    );
    let through = [
        0xbd, 0x1c, 0x00, 0x00, 0x00, // mov $0x1c,%ebp
        0x48, 0x89, 0xee, // mov %rbp,%rsi
        0xff, 0xd0, // call *%rax
    ];
    assert_eq!(
        constant_request(&through, 0x1000, &through, 0x1000),
        Some(0x1c)
    );
    // mov $0xa0,%esi; jmp +2; (skipped: ud2); call *%rax
    let jumped = [
        0xbe, 0xa0, 0x00, 0x00, 0x00, 0xeb, 0x02, 0x0f, 0x0b, 0xff, 0xd0,
    ];
    assert_eq!(
        constant_request(&jumped, 0x1000, &jumped, 0x1000),
        Some(0xa0)
    );
    // %rsi overwritten by a load, or a call before: nothing.
    let loaded = [
        0xbe, 0x78, 0x00, 0x00, 0x00, // mov $0x78,%esi
        0x48, 0x8b, 0x37, // mov (%rdi),%rsi
        0xff, 0xd0, // call *%rax
    ];
    assert_eq!(constant_request(&loaded, 0x1000, &loaded, 0x1000), None);
    assert!(in_class(0x78, 128) && !in_class(0x70, 128) && !in_class(129, 128));
}
