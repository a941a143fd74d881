//! `teraio run` (being built).

use crate::{CliError, Result};

/// Options of `teraio run`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Run `teraio run`.
pub fn run(_args: Args) -> Result<()> {
    Err(CliError::Usage("teraio run is not built yet".into()))
}
