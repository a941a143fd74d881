//! `teraio analyze` (being built).

use crate::{CliError, Result};

/// Options of `teraio analyze`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Run `teraio analyze`.
pub fn run(_args: Args) -> Result<()> {
    Err(CliError::Usage("teraio analyze is not built yet".into()))
}
