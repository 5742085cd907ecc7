//! The cell-running child's side of reporting a failed `?`.
//!
//! evcxr wraps each cell in a closure returning `Result`: a `?` that fails prints the error to
//! stderr and a marker line to stdout, which evcxr consumes to drop the cell's new variables — and
//! tells its caller nothing, so the cell looked successful and "run all" went on past it. In the
//! child we put a relay between the process's stdout and the pipe evcxr reads: it passes every
//! byte through unchanged and, after evcxr's marker line, adds [`CELL_FAILED`], which evcxr hands
//! to the kernel as an ordinary output line.

use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

/// The line the relay adds after a failed `?`; the kernel removes it from the output.
pub const CELL_FAILED: &str = "ART_KERNEL_CELL_FAILED";

/// What evcxr 0.22's cell wrapper prints when a `?` returns early
/// (`evcxr_internal_runtime::USER_ERROR_OCCURRED`).
const EVCXR_ERROR_LINE: &[u8] = b"EVCXR_ERROR_OCCURRED";

/// evcxr starts its cell-running child with this variable set (`runtime::EVCXR_IS_RUNTIME_VAR`).
const EVCXR_CHILD_VAR: &str = "EVCXR_IS_RUNTIME";

/// In evcxr's child process, routes stdout through the relay; elsewhere does nothing. Must run
/// before `evcxr::runtime_hook`, which never returns in the child.
pub fn relay_stdout_if_child() {
    if std::env::var_os(EVCXR_CHILD_VAR).is_none() {
        return;
    }
    if let Err(error) = start_relay() {
        // Without the relay cells still run; a failed `?` is then only printed.
        eprintln!("art-kernel: cannot watch the cell output for errors: {error}");
    }
}

fn start_relay() -> std::io::Result<()> {
    let mut fds = [0; 2];
    // SAFETY: `pipe` writes two fresh descriptors into `fds`, which nothing else owns; each is
    // wrapped in an `OwnedFd` at once, so every early return below closes them.
    let (reader, writer) = unsafe {
        if libc::pipe(fds.as_mut_ptr()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))
    };
    // The original stdout, kept for the relay to write to.
    let parent = std::io::stdout().as_fd().try_clone_to_owned()?;
    // The relay starts before stdout is redirected, so a failed start leaves stdout as it was.
    std::thread::Builder::new()
        .name("art-kernel-stdout-relay".into())
        .spawn(move || {
            let _ = relay(std::fs::File::from(reader), std::fs::File::from(parent));
        })?;
    // SAFETY: dup2 onto fd 1 replaces stdout atomically; both descriptors are valid and owned
    // here. The pipe's write end is closed when `writer` drops (fd 1 keeps the pipe open; if
    // dup2 fails, the relay sees the end of its input and stops).
    if unsafe { libc::dup2(writer.as_raw_fd(), 1) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Copies `from` to `to` as bytes arrive, adding a [`CELL_FAILED`] line right after each evcxr
/// error line (before anything that follows it, such as evcxr's end-of-cell line).
fn relay(mut from: impl Read, mut to: impl Write) -> std::io::Result<()> {
    let mut buffer = [0u8; 8192];
    let mut line = Vec::new();
    loop {
        let n = from.read(&mut buffer)?;
        if n == 0 {
            return Ok(());
        }
        let mut written = 0;
        for (i, &byte) in buffer[..n].iter().enumerate() {
            if byte != b'\n' {
                // Only the start of a line is needed to recognise the marker.
                if line.len() <= EVCXR_ERROR_LINE.len() {
                    line.push(byte);
                }
                continue;
            }
            if line == EVCXR_ERROR_LINE {
                to.write_all(&buffer[written..=i])?;
                to.write_all(format!("{CELL_FAILED}\n").as_bytes())?;
                written = i + 1;
            }
            line.clear();
        }
        to.write_all(&buffer[written..n])?;
        to.flush()?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_relay_passes_output_through_and_marks_failed_cells() {
        let input =
            b"hello\nEVCXR_ERROR_OCCURRED\nEVCXR_ERROR_OCCURRED_NOT\nEVCXR_EXECUTION_COMPLETE\n";
        let mut output = Vec::new();
        relay(&input[..], &mut output).unwrap();
        assert_eq!(
            String::from_utf8(output).unwrap(),
            format!("hello\nEVCXR_ERROR_OCCURRED\n{CELL_FAILED}\nEVCXR_ERROR_OCCURRED_NOT\nEVCXR_EXECUTION_COMPLETE\n")
        );
    }
}
