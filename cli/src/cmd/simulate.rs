//! `teraio simulate` (being built).

use crate::{CliError, Result};

/// Options of `teraio simulate`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Run `teraio simulate`.
pub fn run(_args: Args) -> Result<()> {
    Err(CliError::Usage("teraio simulate is not built yet".into()))
}
