//! `teraio advise` (being built).

use crate::{CliError, Result};

/// Options of `teraio advise`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Run `teraio advise`.
pub fn run(_args: Args) -> Result<()> {
    Err(CliError::Usage("teraio advise is not built yet".into()))
}
