use super::*;

#[test]
fn a_library_loaded_after_the_maps_were_read_normalizes_at_once() {
    let pid = std::process::id();
    let mapped = std::fs::read_to_string("/proc/self/maps").unwrap();
    // Each by its name and the start of its file's name (the maps name the file).
    let Some((name, stem)) = [
        ("libz.so.1", "/libz.so"),
        ("libbz2.so.1.0", "/libbz2.so"),
        ("liblzma.so.5", "/liblzma.so"),
        ("libexpat.so.1", "/libexpat.so"),
    ]
    .into_iter()
    .find(|(_, stem)| !mapped.contains(stem)) else {
        return;
    };
    let mut normalizer = AddressNormalizer::new();
    normalizer.prime(pid);
    let c_name = std::ffi::CString::new(name).unwrap();
    // SAFETY: loading a system library that runs no constructor of interest.
    let handle = unsafe { libc::dlopen(c_name.as_ptr(), libc::RTLD_NOW) };
    if handle.is_null() {
        return;
    }
    let code = procfs::read_maps(pid)
        .into_iter()
        .find(|e| e.executable && e.name.to_string_lossy().contains(stem))
        .expect("the library's code is mapped");
    // Within a second of the first read: the process's own maps tell it is new.
    let frames = normalizer.normalize(pid, &[code.range.start + 16]);
    assert!(
        matches!(frames[0], Frame::Module { .. }),
        "{name}: {frames:?}"
    );
    // A garbage address costs one more read at most per 100 ms, and stays unknown.
    assert_eq!(normalizer.normalize(pid, &[8]), [Frame::Unknown(8)]);
}

#[test]
fn own_function_normalizes_into_this_executable() {
    let mut normalizer = AddressNormalizer::new();
    let addr = own_function_normalizes_into_this_executable as *const () as u64;
    let frames = normalizer.normalize(std::process::id(), &[addr, 8]);
    let Frame::Module { module, .. } = frames[0] else {
        panic!("not normalized: {frames:?}");
    };
    let exe = std::fs::read_link("/proc/self/exe").unwrap();
    assert_eq!(normalizer.modules.get(module).unwrap().path, exe);
    assert_eq!(frames[1], Frame::Unknown(8));
    // Again, from the cache: the same frames, the module frame cached once and
    // the unknown one not at all; forgetting the process drops it.
    let pid = std::process::id();
    assert_eq!(
        normalizer.normalize(pid, &[8, addr]),
        [frames[1], frames[0]]
    );
    assert_eq!(normalizer.cached_frames, 1);
    assert_eq!(normalizer.resolved[&pid][&addr], frames[0]);
    normalizer.forget(pid);
    assert_eq!(normalizer.cached_frames, 0);
    assert!(!normalizer.resolved.contains_key(&pid));
}

/// File `n` of a scratch directory of `test`'s (content `n`, written once), opened
/// anew at each call.
fn own_file(test: &str, n: u8) -> Option<Arc<File>> {
    let dir = std::env::temp_dir().join(format!("module-table-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{n}.so"));
    if !path.exists() {
        std::fs::write(&path, [n]).unwrap();
    }
    Some(Arc::new(File::open(path).unwrap()))
}

#[test]
fn modules_are_interned_once_per_file_whatever_their_build_id() {
    let file = |n| own_file("interned", n);
    let identity = |n| FileIdentity::of(&file(n).unwrap()).unwrap();
    let libc_id = vec![0xab, 0x01];
    let libc = Module {
        path: "/lib/libc.so.6".into(),
        build_id: Some(libc_id.clone()),
    };
    // A stub library carrying libc's build id.
    let stub = Module {
        path: "/home/eve/stub.so".into(),
        build_id: Some(libc_id),
    };
    let mut table = ModuleTable::default();
    let a = table.intern(libc.clone(), None, file(1));
    // The same file through another descriptor, under another path (another
    // process, another container's root): the same module.
    assert_eq!(table.intern(libc.clone(), None, file(1)), a);
    let moved = Module {
        path: "/other/root/lib/libc.so.6".into(),
        ..libc.clone()
    };
    assert_eq!(table.intern(moved, None, file(1)), a);
    // The stub is a module of its own, read from its own file.
    let s = table.intern(stub.clone(), None, file(2));
    assert_ne!(s, a);
    assert_eq!(table.file(a).unwrap().1, identity(1));
    assert_eq!(table.file(s).unwrap().1, identity(2));
    assert_eq!(
        table.get(s).unwrap().path,
        PathBuf::from("/home/eve/stub.so")
    );
    // Seen first, the stub does not become libc either.
    let mut table = ModuleTable::default();
    let s = table.intern(stub, None, file(2));
    let a = table.intern(libc.clone(), None, file(1));
    assert_ne!(s, a);
    assert_eq!(table.file(a).unwrap().1, identity(1));
    // A module whose file could not be opened adopts no other file, and no other
    // module adopts it: never symbolized.
    let unopened = table.intern(libc.clone(), None, None);
    assert!(unopened != a && unopened != s);
    assert!(table.file(unopened).is_none());
    assert_eq!(table.intern(libc.clone(), None, file(1)), a);
    assert_eq!(libc.build_id_hex(), "ab01");
    assert_eq!(table.all().len(), 3);
}

#[test]
fn released_modules_are_closed_forgotten_and_their_ids_reused() {
    let mut table = ModuleTable::default();
    let module = |n: u8| Module {
        path: format!("/lib/{n}.so").into(),
        build_id: Some(vec![n]),
    };
    let (a, b) = (
        table.intern(module(1), None, own_file("released", 1)),
        table.intern(module(2), None, own_file("released", 2)),
    );
    assert_eq!(table.open_files(), 2);
    assert_eq!(table.release_files(|id| id == a), 1);
    assert_eq!(table.open_files(), 1);
    assert_eq!(table.len(), 1, "the released module left the table");
    assert!(table.file(b).is_none());
    // A new module takes the free id; the released one seen again is interned
    // anew, with a file; the kept one is untouched.
    assert_eq!(table.intern(module(3), None, own_file("released", 3)), b);
    assert_eq!(table.get(b).unwrap().path, PathBuf::from("/lib/3.so"));
    let again = table.intern(module(2), None, own_file("released", 2));
    assert!(again != a && again != b);
    assert!(table.file(again).is_some());
    assert_eq!(table.get(a).unwrap().path, PathBuf::from("/lib/1.so"));
    assert_eq!(table.len(), 3);
}
