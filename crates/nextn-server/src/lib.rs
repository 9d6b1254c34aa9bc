//! `nextn serve`: an OpenAI-compatible HTTP server in front of the continuous-batching scheduler
//! (`nextn_engine::scheduler`).
//!
//! The model runs on the scheduler's own inference thread; the async runtime only parses
//! requests, renders chat templates, tokenizes (on blocking threads), fetches image URLs where
//! `--allow-image-urls` allows them ([`image_url`]) and streams events back.
//! Each request gets an unbounded channel for its events; dropping the response (the client went
//! away) closes it, and the scheduler frees the slot at its next step.
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/messages`
//! (Anthropic's Messages API, see [`anthropic`]), `POST /v1/responses` (and
//! `/v1/responses/input_tokens`, `GET` / `DELETE /v1/responses/{id}`), `GET /v1/models`,
//! `GET /health` (503 while loading), `GET /metrics` (see [`prometheus`] for the names).
//!
//! Connections are accepted and limited in [`conn`]: header-read, idle keep-alive and
//! write-stall timeouts, and a cap on open connections.

mod anthropic;
pub mod conn;
pub mod cors;
pub mod error;
mod handler;
pub mod image_url;
mod native;
mod prepare;
pub mod prometheus;
pub mod reasoning;
pub mod request;
mod respond;
mod responses;
mod routes;
pub mod slots;
mod submit;
pub mod tools;
mod unserved;

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use nextn_engine::chat::ChatTemplate;
use nextn_engine::grammar::GrammarCompiler;
use nextn_engine::scheduler::{self, Engine, Phase, SchedulerConfig, SchedulerHandle};
use nextn_engine::tokenizer::Tokenizer;

use tools::ToolFormat;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// Thinking stays in `content`.
    None,
    /// `<think>…</think>` goes to `reasoning_content`.
    Deepseek,
}

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// Accepted `Authorization: Bearer` keys; empty = no authentication.
    pub api_keys: Vec<String>,
    /// The model id reported by `/v1/models` and in responses.
    pub model_id: String,
    pub reasoning: ReasoningFormat,
    /// Largest request body accepted (413 above).
    pub max_body_bytes: usize,
    /// Most images one request may carry (`--max-images`), the conversation it continues included;
    /// more are refused before any is fetched or decoded.
    pub max_images: usize,
    /// On SIGTERM / SIGINT, running requests may finish for this long before they are cancelled.
    pub shutdown_grace: Duration,
    /// Log every finished request to stderr.
    pub log_requests: bool,
    /// Log details such as request fields the server does not know (once each).
    pub debug_log: bool,
    /// Where `POST /slots/{id}?action=save|restore` writes and reads slot files (`None`: the
    /// actions answer 501).
    pub slot_save_path: Option<std::path::PathBuf>,
    /// `--reasoning-budget`: at most this many tokens of reasoning for requests that do not set
    /// `thinking_budget_tokens` (`None`: no cap).
    pub reasoning_budget: Option<usize>,
    /// `--reasoning-budget-message`: written before the closing tag when a budget runs out.
    pub reasoning_budget_message: String,
    /// Chat template variables for requests that do not set them (`--reasoning-budget 0` sets
    /// `enable_thinking: false`).
    pub template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Request fields a request that leaves them out gets (sampling settings and `n_predict`
    /// from the command line), as JSON the request parser reads.
    pub request_defaults: serde_json::Map<String, serde_json::Value>,
    /// The model file, for `/props`.
    pub model_path: String,
    /// The origins browsers may call from (`--cors-origins`): a listed request `Origin` is echoed
    /// alone in `Access-Control-Allow-Origin`, others get no CORS headers.
    pub cors_origins: cors::CorsOrigins,
    /// Allow credentials; with `*` the request's origin is echoed (`--cors-credentials`).
    pub cors_credentials: bool,
    /// `--force-acceptance`: per-position rates at which requests that send their plain output
    /// (`forced_acceptance_reference`) run the speculative loop (measurement only).
    pub forced_acceptance: Option<Vec<f64>>,
    /// Timeouts and the connection cap.
    pub limits: conn::Limits,
    /// `--allow-image-urls`: http(s) image URLs are fetched within these limits, from the
    /// addresses they allow (`None`: they are refused with a 400, and only data URIs are read).
    pub image_urls: Option<image_url::ImageUrlLimits>,
}

/// Why the server could not start or did not stop cleanly.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot start the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read the bound address: {0}")]
    LocalAddr(#[source] std::io::Error),
    #[error("cannot start the inference thread: {0}")]
    InferenceSpawn(#[source] std::io::Error),
    #[error("cannot set up the HTTP client for image URLs: {0}")]
    ImageClient(#[source] reqwest::Error),
    /// The model did not load (the loader's message).
    #[error("{0}")]
    Load(String),
    #[error("the inference thread ended abnormally")]
    InferenceThread,
    #[error(transparent)]
    Sealer(#[from] responses::sealed::SealerError),
}

/// What the loader hands over once the model is read.
pub struct Loaded {
    pub engine: Engine,
    pub scheduler: SchedulerConfig,
    pub template: ChatTemplate,
    /// Start-up lines to log (what was loaded, memory reserved).
    pub description: String,
}

/// Tokenizer and template for the request side, available once loading finished.
pub(crate) struct Frontend {
    pub tokenizer: Arc<Tokenizer>,
    pub template: ChatTemplate,
    /// How the template has the model write tool calls.
    pub tool_format: ToolFormat,
    /// Width of the model's logits rows.
    pub n_vocab: usize,
    /// The vision tower (`--mmproj`): requests with images are refused without it.
    pub vision: Option<Arc<nextn_vision::VisionTower>>,
    /// Built while the server loads ([`Frontend::new`]): the token trie over the vocabulary
    /// takes a moment (0.6 s for Qwen's 248,320 tokens on one core), and every agent's first
    /// request has tools, whose call grammar needs it.
    grammars: Result<GrammarCompiler, String>,
}

impl Frontend {
    fn new(engine: &Engine, template: ChatTemplate) -> Frontend {
        let grammars = GrammarCompiler::new(&engine.tokenizer, engine.model.n_vocab)
            .map_err(|e| e.to_string());
        if let Err(e) = &grammars {
            // Kept: each request with a grammar or tools is refused with it.
            eprintln!("warning: grammars and tool calls are unavailable: {e}");
        }
        Frontend {
            tokenizer: engine.tokenizer.clone(),
            tool_format: ToolFormat::of_template(template.source()),
            template,
            n_vocab: engine.model.n_vocab,
            vision: engine.vision.clone(),
            grammars,
        }
    }

    pub fn grammars(&self) -> Result<&GrammarCompiler, String> {
        self.grammars.as_ref().map_err(Clone::clone)
    }
}

pub(crate) struct App {
    pub cfg: ServerConfig,
    pub handle: SchedulerHandle,
    pub frontend: OnceLock<Arc<Frontend>>,
    pub connections: Arc<conn::ConnStats>,
    /// Responses kept for `previous_response_id` and `GET /v1/responses/{id}`.
    pub responses: responses::store::Store,
    /// Seals reasoning into Responses' `encrypted_content` and draws response ids.
    pub sealer: Arc<responses::sealed::Sealer>,
    /// Fetches image URLs (`--allow-image-urls`); `None`: they are refused.
    pub image_fetcher: Option<image_url::ImageFetcher>,
}

/// After the shutdown grace period has cancelled what was still running, connections get this
/// long to deliver the last events (the error and `[DONE]`) before they are closed regardless.
const DELIVERY_AFTER_GRACE: Duration = Duration::from_secs(5);

/// Bind, start loading the model on the inference thread, and serve until SIGTERM / SIGINT (or a
/// failed load). Returns when every connection is closed and the inference thread has ended.
pub fn run<L>(cfg: ServerConfig, load: L) -> Result<(), ServeError>
where
    L: FnOnce() -> Result<Loaded, String> + Send + 'static,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("nextn-http")
        .enable_all()
        .build()
        .map_err(ServeError::Runtime)?;
    runtime.block_on(serve(cfg, load))
}

async fn serve<L>(cfg: ServerConfig, load: L) -> Result<(), ServeError>
where
    L: FnOnce() -> Result<Loaded, String> + Send + 'static,
{
    let image_fetcher = cfg
        .image_urls
        .clone()
        .map(image_url::ImageFetcher::new)
        .transpose()
        .map_err(ServeError::ImageClient)?;
    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| ServeError::Listen {
            addr: addr.clone(),
            source,
        })?;
    let local: SocketAddr = listener.local_addr().map_err(ServeError::LocalAddr)?;

    let frontend_slot: Arc<OnceLock<Arc<Frontend>>> = Arc::new(OnceLock::new());
    let fs = frontend_slot.clone();
    let (handle, inference) = scheduler::spawn(move || {
        let loaded = load()?;
        eprintln!("{}", loaded.description);
        let _ = fs.set(Arc::new(Frontend::new(&loaded.engine, loaded.template)));
        Ok((loaded.engine, loaded.scheduler))
    })
    .map_err(ServeError::InferenceSpawn)?;

    let grace = cfg.shutdown_grace;
    let limits = cfg.limits;
    let connections = Arc::new(conn::ConnStats::default());
    let app = Arc::new(App {
        cfg,
        handle: handle.clone(),
        frontend: OnceLock::new(),
        connections: connections.clone(),
        responses: Default::default(),
        sealer: Arc::new(responses::sealed::Sealer::new()?),
        image_fetcher,
    });
    let router = routes::router(app.clone());
    // The HTTP side sees the frontend as soon as the loader publishes it.
    let watcher = {
        let app = app.clone();
        let handle = handle.clone();
        tokio::spawn(async move {
            loop {
                match handle.phase() {
                    Phase::Loading => tokio::time::sleep(Duration::from_millis(20)).await,
                    Phase::Ready => {
                        if let Some(f) = frontend_slot.get() {
                            let _ = app.frontend.set(f.clone());
                        }
                        if let Some(info) = handle.info() {
                            if let Some(c) = &info.calibration {
                                eprintln!("{c}");
                            }
                            eprintln!(
                                "ready: {} slots of {} tokens, {}",
                                info.n_slots,
                                info.n_ctx_slot,
                                if info.speculative {
                                    format!("MTP drafting up to {} tokens", info.n_draft_max)
                                } else {
                                    "no speculative decoding".into()
                                }
                            );
                        }
                        return Ok(());
                    }
                    Phase::Failed | Phase::Stopped => {
                        return Err(handle
                            .failure()
                            .unwrap_or_else(|| "the model failed to load".into()));
                    }
                }
            }
        })
    };
    eprintln!(
        "connections: at most {} at once; request heads within {:.0} s, idle keep-alive {:.0} s, stalled writes {:.0} s",
        limits.max_connections,
        limits.header_read.as_secs_f64(),
        limits.idle.as_secs_f64(),
        limits.write_stall.as_secs_f64()
    );
    if let Some(l) = &app.cfg.image_urls {
        eprintln!(
            "image URLs: fetched (--allow-image-urls), at most {} per request, {} bytes in {} s each, from {}",
            l.max_urls,
            l.max_bytes,
            l.timeout.as_secs_f64(),
            l.addresses
        );
    }
    eprintln!("listening on http://{local} (model loading; /health answers 503 until ready)");

    let load_result: Arc<std::sync::Mutex<Option<String>>> = Arc::new(std::sync::Mutex::new(None));
    let lr = load_result.clone();
    let shutdown = async move {
        tokio::select! {
            _ = termination() => eprintln!("shutting down: finishing running requests (up to {:.0} s)", grace.as_secs_f64()),
            r = watcher => {
                let failed = match r {
                    Ok(Ok(())) => None,
                    Ok(Err(e)) => Some(e),
                    Err(e) => Some(format!("the start-up watcher failed: {e}")),
                };
                match failed {
                    Some(e) => *lr.lock().unwrap_or_else(|p| p.into_inner()) = Some(e),
                    None => termination().await,
                }
            }
        }
        handle.shutdown(grace);
        tokio::time::Instant::now() + grace + DELIVERY_AFTER_GRACE
    };
    conn::serve(listener, router, limits, connections, shutdown).await;
    app.handle.shutdown(Duration::ZERO);
    let joined = tokio::task::spawn_blocking(move || inference.join()).await;
    if let Some(e) = load_result.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(ServeError::Load(e));
    }
    match joined {
        Ok(Ok(())) => Ok(()),
        _ => Err(ServeError::InferenceThread),
    }
}

/// SIGTERM or SIGINT (Ctrl-C).
async fn termination() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
