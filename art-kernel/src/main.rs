//! `art-kernel`: the Jupyter kernel for ART notebooks. Not built yet (see the kernel issue); this binary
//! only says so, so that nobody mistakes it for a working kernel.

fn main() {
    eprintln!("art-kernel: the Jupyter kernel is not implemented yet");
    std::process::exit(2);
}
