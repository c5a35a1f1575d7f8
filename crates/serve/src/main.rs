//! `candle-maxsim-serve --index DIR [--model DIR] [--cuda] [--port P] ...`:
//! serves an existing PLAID index over HTTP (see the crate's README).

use anyhow::{bail, Context};
use candle_core::{DType, Device};
use candle_maxsim_colbert::ColBert;
use candle_maxsim_plaid::PlaidIndex;
use candle_maxsim_serve::{Config, Metadata, Service};
use clap::Parser;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(version, about = "Search service over a candle-maxsim PLAID index")]
struct Args {
    /// The index directory (built by candle-maxsim-plaid or fast-plaid).
    #[arg(long)]
    index: PathBuf,
    /// A ColBERT checkpoint directory, for text queries and documents.
    #[arg(long)]
    model: Option<PathBuf>,
    /// The metadata database (default: `<index>.metadata.sqlite` beside the index directory).
    #[arg(long)]
    metadata: Option<PathBuf>,
    /// cpu or cuda (CUDA device 0; needs the `cuda` feature).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Same as `--device cuda`.
    #[arg(long)]
    cuda: bool,
    /// The model's dtype: f32, f16 or bf16 (default: f16 on CUDA, f32 on the CPU).
    #[arg(long)]
    model_dtype: Option<String>,
    /// Device memory the index may take, in MiB: past it, its residuals stay
    /// in host memory and each search copies only its candidates' rows.
    #[arg(long)]
    device_budget_mb: Option<usize>,
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Writes need this key (`x-api-key` or `Authorization: Bearer`).
    #[arg(long)]
    api_key: Option<String>,
    /// Reads need the key too (all but /health).
    #[arg(long)]
    protect_reads: bool,
    /// How long a search waits for others when no batch runs (those
    /// arriving while one runs always join the next).
    #[arg(long, default_value_t = 0.0)]
    batch_window_ms: f64,
    /// Queries per batch at most.
    #[arg(long, default_value_t = 256)]
    max_batch: usize,
    /// Request bodies larger than this many MiB are refused.
    #[arg(long, default_value_t = 32)]
    max_body_mb: usize,
    /// Queries per search request at most.
    #[arg(long, default_value_t = 256)]
    max_queries: usize,
    /// Documents per add request at most.
    #[arg(long, default_value_t = 10_000)]
    max_documents: usize,
    /// Tokens per added document at most.
    #[arg(long, default_value_t = 8192)]
    max_document_tokens: usize,
    /// A filter running longer than this is interrupted.
    #[arg(long, default_value_t = 2000)]
    filter_timeout_ms: u64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let device = match (args.cuda, args.device.as_str()) {
        (true, _) | (false, "cuda") => {
            Device::new_cuda(0).context("--cuda: CUDA device 0 (build with --features cuda)")?
        }
        (false, "cpu") => Device::Cpu,
        (false, d) => bail!("--device: `{d}` is neither cpu nor cuda"),
    };
    if !args.index.join("metadata.json").exists() {
        // The engine builds an index from documents (`create`), not an empty one.
        bail!(
            "--index: {} is not an index (no metadata.json); build one first with candle_maxsim_plaid::create",
            args.index.display()
        )
    }
    if !(args.batch_window_ms.is_finite() && (0.0..=10_000.0).contains(&args.batch_window_ms)) {
        bail!("--batch-window-ms: must be between 0 and 10000, got {}", args.batch_window_ms)
    }
    let index = match args.device_budget_mb {
        None => PlaidIndex::load(&args.index, &device),
        Some(mb) => PlaidIndex::load_with_device_budget(&args.index, &device, mb << 20),
    }
    .with_context(|| format!("--index {}", args.index.display()))?;
    let model = match &args.model {
        None => None,
        Some(dir) => {
            let dtype = match args.model_dtype.as_deref() {
                None if device.is_cuda() => DType::F16,
                None | Some("f32") => DType::F32,
                Some("f16") => DType::F16,
                Some("bf16") => DType::BF16,
                Some(d) => bail!("--model-dtype: `{d}` is not f32, f16 or bf16"),
            };
            Some(ColBert::load(dir, &device, dtype).with_context(|| format!("--model {}", dir.display()))?)
        }
    };
    let meta_path = match &args.metadata {
        Some(p) => p.clone(),
        None => {
            let name = args.index.file_name().context("--index: the directory needs a name")?;
            args.index.with_file_name(format!("{}.metadata.sqlite", name.to_string_lossy()))
        }
    };
    let config = Config {
        batch_window: Duration::from_secs_f64(args.batch_window_ms / 1e3),
        max_batch: args.max_batch,
        max_body_bytes: args.max_body_mb << 20,
        max_queries: args.max_queries,
        max_documents: args.max_documents,
        max_document_tokens: args.max_document_tokens,
        api_key: args.api_key.clone(),
        protect_reads: args.protect_reads,
        filter_timeout: Duration::from_millis(args.filter_timeout_ms),
        ..Config::default()
    };
    let metadata = Metadata::open(&meta_path, config.filter_timeout)?;
    let service = Service::new(index, model, metadata, config)?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("--port: bind {addr}"))?;
        let local = listener.local_addr()?;
        let stats = service.stats()?;
        // The one line a supervisor (or a test) waits for.
        println!(
            "listening on http://{local} ({} documents, dim {}, {})",
            stats["documents"],
            stats["dim"],
            stats["device"].as_str().unwrap_or("?")
        );
        candle_maxsim_serve::serve_with_shutdown(listener, service, shutdown()).await?;
        anyhow::Ok(())
    })
}

/// Completes on Ctrl-C or SIGTERM.
async fn shutdown() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}
