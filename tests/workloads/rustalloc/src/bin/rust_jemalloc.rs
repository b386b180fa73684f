//! The sites with tikv-jemallocator as the global allocator.

#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() {
    rustalloc::main_protocol();
}
