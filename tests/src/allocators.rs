//! The allocators of Debian the end-to-end tests run workloads under, preloaded or
//! linked (`cargo xtask setup` installs them: libjemalloc2, libtcmalloc-minimal4,
//! libmimalloc2.0, musl-tools).

use std::path::Path;

/// One allocator library.
#[derive(Clone, Copy, Debug)]
pub struct Allocator {
    /// The family name allocbpf's start-up line gives it.
    pub family: &'static str,
    /// The shared library (runtime package only: linked by path, no -dev package).
    pub library: &'static str,
}

/// jemalloc 5.3, gperftools' tcmalloc (minimal) 2.10 and mimalloc 2.0, as Debian ships them.
pub const ALLOCATORS: &[Allocator] = &[
    Allocator {
        family: "jemalloc",
        library: "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    },
    Allocator {
        family: "tcmalloc",
        library: "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    },
    Allocator {
        family: "mimalloc",
        library: "/usr/lib/x86_64-linux-gnu/libmimalloc.so.2",
    },
];

impl Allocator {
    /// `LD_PRELOAD` for running a program under this allocator.
    pub fn preload(&self) -> [(&'static str, &'static str); 1] {
        assert!(
            Path::new(self.library).exists(),
            "{} is missing (cargo xtask setup installs it)",
            self.library
        );
        [("LD_PRELOAD", self.library)]
    }

    /// A short name for binaries and scratch directories.
    pub fn short(&self) -> &'static str {
        self.family
    }
}
