//! The sites with the mimalloc crate as the global allocator.

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    rustalloc::main_protocol();
}
