use super::*;

#[test]
fn civil_dates() {
    assert_eq!(day_of(0), "1970-01-01");
    assert_eq!(day_of(951_782_400_000), "2000-02-29");
    assert_eq!(day_of(1_795_305_600_000), "2026-11-22");
}

/// A wall clock jumping years ahead does not age the store: retention goes by the
/// time elapsed until the clock agrees again; size and count bounds still apply.
#[test]
fn retention_ignores_a_forward_clock_jump() {
    let root = std::env::temp_dir().join(format!("allocbpf-store-jump-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let retention = Retention {
        max_age: Duration::from_secs(3600),
        max_bytes: 1 << 20,
        max_files: 1000,
    };
    let mut store = ProfileStore::open(&root, retention).unwrap();
    let now = SystemTime::now();
    // Ended 50, 40, ... 10 minutes ago: all younger than max_age.
    for i in 0..5u64 {
        let end = now - Duration::from_secs(600 * (5 - i));
        store
            .write(
                end - Duration::from_secs(60),
                end,
                10 + i as u32,
                "w",
                &[0u8; 100],
            )
            .unwrap();
    }
    let boot = Duration::from_secs(1000);
    let mut clock = RetentionClock::anchored(now, boot);
    // Small steps, forward and back, are followed.
    assert_eq!(
        clock.at(now + Duration::from_secs(60), boot),
        now + Duration::from_secs(60)
    );
    assert_eq!(clock.at(now, boot), now);
    // A year ahead after a minute: the minute counts, not the year.
    let year = Duration::from_secs(365 * 86_400);
    let minute = Duration::from_secs(60);
    let aged_by = clock.at(now + year, boot + minute);
    assert_eq!(aged_by, now + minute);
    assert_eq!(store.enforce_retention(aged_by), 0);
    assert_eq!(store.len(), 5);
    // Still ignored 15 minutes on: the oldest reaches max_age by elapsed time.
    let later = Duration::from_secs(900);
    let aged_by = clock.at(now + year + later, boot + later);
    assert_eq!(aged_by, now + later);
    assert_eq!(store.enforce_retention(aged_by), 1);
    // The size bound still applies.
    store.set_retention(Retention {
        max_bytes: 250,
        ..retention
    });
    assert_eq!(store.enforce_retention(aged_by), 2);
    // The clock back where elapsed time says: followed again.
    let back = now + Duration::from_secs(1000);
    assert_eq!(clock.at(back, boot + Duration::from_secs(1000)), back);
    // Every directory the writes and deletions touched, synced once.
    assert!(!store.dirty.is_empty());
    store.sync_dirs().unwrap();
    assert!(store.dirty.is_empty());
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn write_list_and_retention_by_size_and_age() {
    let root = std::env::temp_dir().join(format!("allocbpf-store-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let mut store = ProfileStore::open(
        &root,
        Retention {
            max_age: Duration::from_secs(3600),
            max_bytes: 250,
            max_files: 1000,
        },
    )
    .unwrap();
    let now = SystemTime::now();
    for i in 0..5u64 {
        let end = now - Duration::from_secs(7200) + Duration::from_secs(1800 * i);
        store
            .write(
                end - Duration::from_secs(60),
                end,
                10 + i as u32,
                "a/b c",
                &[0u8; 100],
            )
            .unwrap();
    }
    let listed = list(&root).unwrap();
    assert_eq!(listed.len(), 5);
    // A crash's partial file is removed when the store opens.
    let partial = listed[0].path.with_file_name(".1-2.tmp");
    std::fs::write(&partial, b"partial").unwrap();
    drop(ProfileStore::open(&root, store.retention).unwrap());
    assert!(!partial.exists());
    // Private whatever the umask: profiles reveal other users' binaries.
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&root), 0o700);
    assert_eq!(mode(&root.join("profiles")), 0o700);
    assert_eq!(mode(listed[0].path.parent().unwrap()), 0o700);
    assert_eq!(mode(&listed[0].path), 0o600);
    assert_eq!(listed[0].comm, "a_b_c");
    assert_eq!(listed[0].pid, 10);
    // Ends at -2h, -1.5h, -1h, -0.5h, 0: two are older than 1h; 300 bytes > 250.
    let deleted = store.enforce_retention(now);
    assert_eq!(deleted, 3);
    assert_eq!(store.len(), 2);
    assert!(store.total_bytes() <= 250);
    assert_eq!(list(&root).unwrap().len(), 2);
    // Reopening rebuilds the same index.
    let mut reopened = ProfileStore::open(&root, store.retention).unwrap();
    assert_eq!(reopened.len(), 2);
    assert_eq!(reopened.total_bytes(), 200);
    // The file count bounds the index too.
    reopened.set_retention(Retention {
        max_files: 1,
        ..store.retention
    });
    assert_eq!(reopened.enforce_retention(now), 1);
    assert_eq!(list(&root).unwrap().len(), 1);
    assert_eq!(list(&root).unwrap()[0].pid, 14, "the newest is kept");
    std::fs::remove_dir_all(&root).unwrap();
}
