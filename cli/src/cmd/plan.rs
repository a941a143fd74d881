//! `teraio plan` (being built).

use crate::{CliError, Result};

/// Options of `teraio plan`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Run `teraio plan`.
pub fn run(_args: Args) -> Result<()> {
    Err(CliError::Usage("teraio plan is not built yet".into()))
}
