//! `teraio inspect` (being built).

use crate::{CliError, Result};

/// Options of `teraio inspect`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Run `teraio inspect`.
pub fn run(_args: Args) -> Result<()> {
    Err(CliError::Usage("teraio inspect is not built yet".into()))
}
