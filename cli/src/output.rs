//! Standard output of the commands: [`outln!`] and the function behind it. A module of its
//! own (not a command's) so that every command can print without depending on another one.

/// `println!` for command output: when standard output is a pipe whose reader has gone
/// (`teraio ... | head`), exit quietly with status 0 (as ripgrep does) instead of panicking
/// with "Broken pipe".
macro_rules! outln {
    () => {
        $crate::output::write_stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::output::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}
pub(crate) use outln;

/// Write to standard output; see [`outln`]. Any other write error ends the process with
/// status 1 and the error on standard error.
pub fn write_stdout(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    if let Err(e) = std::io::stdout().lock().write_fmt(args) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: writing to standard output: {e}");
        std::process::exit(1);
    }
}
