//! `teraio trace` (being built).

use crate::{CliError, Result};

/// Subcommands of `teraio trace`.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Generate a synthetic training trace.
    Gen,
}

/// Run `teraio trace`.
pub fn run(_cmd: Command) -> Result<()> {
    Err(CliError::Usage("teraio trace is not built yet".into()))
}
