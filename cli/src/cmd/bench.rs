//! `teraio bench` (being built).

use crate::{CliError, Result};

/// Options of `teraio bench`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Run `teraio bench`.
pub fn run(_args: Args) -> Result<()> {
    Err(CliError::Usage("teraio bench is not built yet".into()))
}
