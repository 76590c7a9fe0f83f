use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use acceld::run::{self, RunArgs};
use acceld::serve::{self, ServeArgs};

/// acceld: vhost-user-blk server for QEMU guests, io_uring on raw images.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Serve one image on one vhost-user-blk socket (like qemu-storage-daemon's export).
    Serve(ServeArgs),
    /// Run the supervisor: serve registered VMs' drives, attach over QMP, switch engines.
    Run(RunArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("ACCELD_LOG").unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let res: Result<(), Box<dyn std::error::Error>> = match &cli.cmd {
        Cmd::Serve(a) => serve::run(a).map_err(Into::into),
        Cmd::Run(a) => run::run(a).map_err(Into::into),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("acceld: {}", acceld::error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}
