//! Handing a prepared request to the scheduler: the checks against the loaded model (vocabulary,
//! context), forced acceptance, the event channel, and what a refused submission answers.

use nextn_engine::media::is_image_token;
use nextn_engine::scheduler::SubmitError;
use nextn_engine::speculative::forced::ForcedAcceptance;

use crate::error::ApiError;
use crate::handler::AppState;
use crate::prepare::{exceeds_context, Prepared};
use crate::request::GenParams;
use crate::respond::{self, Shaping};

pub(crate) fn submit_error(e: SubmitError) -> ApiError {
    match e {
        SubmitError::QueueFull(_) => {
            ApiError::unavailable(format!("the server is busy: {e}; retry later"))
        }
        SubmitError::Loading => ApiError::unavailable("Loading model"),
        SubmitError::ShuttingDown => ApiError::unavailable("the server is shutting down"),
        SubmitError::Stopped(_) => ApiError::internal(e.to_string()),
    }
}

/// A request handed to the scheduler: its event channel, and how its answer is to be shaped.
pub(crate) struct Submitted {
    pub rx: tokio::sync::mpsc::UnboundedReceiver<nextn_engine::scheduler::Event>,
    pub params: GenParams,
    pub shaping: Shaping,
}

/// Check a prepared request against the loaded model and hand it to the scheduler.
pub(crate) fn enqueue(app: &AppState, prepared: Prepared) -> Result<Submitted, ApiError> {
    let Prepared {
        params,
        tokens,
        images,
        cache_points: prepared_cache_points,
        grammar,
        shaping,
    } = prepared;
    let info = app
        .handle
        .info()
        .ok_or_else(|| ApiError::unavailable("Loading model"))?;
    if tokens.is_empty() {
        return Err(ApiError::invalid_field("prompt", "the prompt is empty"));
    }
    if let Some(&bad) = tokens
        .iter()
        .find(|&&t| t as usize >= info.n_vocab && !is_image_token(t))
    {
        return Err(ApiError::invalid_field(
            "prompt",
            format!(
                "token id {bad} is out of range: the vocabulary has {} tokens",
                info.n_vocab
            ),
        ));
    }
    if tokens.len() >= info.n_ctx_slot {
        return Err(exceeds_context(
            tokens.len(),
            images.iter().map(|im| im.n_tokens()).sum(),
            images.len(),
            info.n_ctx_slot,
        ));
    }
    let forced_acceptance = match (&params.forced_reference, &app.cfg.forced_acceptance) {
        (None, _) => None,
        (Some(_), None) => {
            return Err(ApiError::invalid_field(
                "forced_acceptance_reference",
                "'forced_acceptance_reference' needs a server started with --force-acceptance",
            ))
        }
        (Some(reference), Some(rates)) => Some(
            ForcedAcceptance::new(rates, params.sampler.seed, reference.clone())
                .map_err(|e| ApiError::bad_request(e.to_string()))?,
        ),
    };
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let request = nextn_engine::scheduler::Request {
        prompt: tokens,
        sampler: params.sampler.clone(),
        n_predict: params.n_predict,
        stop: params.stop.clone(),
        ignore_eos: params.ignore_eos,
        trace: false,
        grammar,
        logprobs: params.logprobs,
        cache_prompt: params.cache_prompt,
        cache_points: prepared_cache_points,
        forced_acceptance,
        // As llama-server: progress is part of a stream only.
        images,
        prompt_progress: params.return_progress && params.stream,
        sink: Box::new(respond::ChannelSink(tx)),
    };
    app.handle.submit(request).map_err(submit_error)?;
    Ok(Submitted {
        rx,
        params,
        shaping,
    })
}
