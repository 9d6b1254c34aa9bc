//! The request side every generating endpoint shares: a parsed request as what the scheduler
//! runs (the chat template, the prompt's tokens, `logit_bias` as token ids, the grammar for
//! `tool_choice` or the output format, and how the answer is cut into reasoning, content and tool
//! calls).

use axum::http::StatusCode;
use nextn_engine::chat::final_header;
use nextn_engine::grammar::{Constraint, GrammarSource, ReasoningBudget};
use nextn_engine::media::{ImageInput, MultimodalPrompt, PromptImage, PromptText};
use nextn_vision::{decode_image, image_size, VisionTower};
use serde_json::json;

use crate::error::ApiError;
use crate::reasoning::{self, prompt_opens_thinking, ReasoningSplitter};
use crate::request::{BiasKey, ChatImage, ChatRequest, GenParams};
use crate::respond::Shaping;
use crate::tools::{call_grammar, Reasoning, ToolCallParser, ToolChoice};
use crate::{App, Frontend, ReasoningFormat};

/// Everything a request needs before it is submitted, prepared off the async threads.
pub(crate) struct Prepared {
    pub params: GenParams,
    pub tokens: Vec<u32>,
    /// The prompt's images at their rows of `tokens`.
    pub images: Vec<PromptImage>,
    /// Prompt positions worth a prefix-cache snapshot.
    pub cache_points: Vec<usize>,
    pub grammar: Option<Constraint>,
    pub shaping: Shaping,
}

impl Prepared {
    /// Tokens of the prompt.
    pub(crate) fn prompt_len(&self) -> usize {
        self.tokens.len()
    }
}

fn uses_tools(req: &ChatRequest) -> bool {
    !req.tools.is_empty() && req.tool_choice != ToolChoice::None
}

/// The text a chat request runs: its messages through the template, with its template
/// variables, the server's defaults for those it leaves out, and its tools; a final assistant
/// message is continued.
pub(crate) fn render_chat(app: &App, fe: &Frontend, req: &ChatRequest) -> Result<String, ApiError> {
    let mut kwargs = req.template_kwargs.clone();
    for (k, v) in &app.cfg.template_kwargs {
        kwargs.entry(k.clone()).or_insert_with(|| v.clone());
    }
    if uses_tools(req) && !kwargs.contains_key("tools") {
        kwargs.insert("tools".into(), req.tools_for_template.clone());
    }
    let continue_last = req.messages.last().is_some_and(|m| m.role == "assistant");
    let rendered = if continue_last {
        fe.template.render_prefill(&req.messages, &kwargs)
    } else {
        fe.template.render(&req.messages, true, &kwargs)
    };
    rendered.map_err(|e| ApiError::bad_request(e.to_string()))
}

/// Compile a grammar for a request; a grammar that does not compile is the request's fault.
pub(crate) fn compile(
    fe: &Frontend,
    source: &GrammarSource,
    param: &str,
) -> Result<Constraint, ApiError> {
    let compiler = fe.grammars().map_err(ApiError::internal)?;
    compiler
        .compile(source)
        .map_err(|e| ApiError::invalid_field(param, format!("'{param}': {e}")))
}

/// `text` as prompt tokens with each of `images` at its placeholder (decoded, sized for the
/// vision tower and laid out as its rows), for a prompt that is to run in a slot: each image's
/// size is read from its header and its rows counted from it, and a prompt that does not fit the
/// slot's context with them is refused (the 400 of [`exceeds_context`]) before any image is
/// decoded. Without images, plain tokens.
pub(crate) fn tokenize_within_context(
    app: &App,
    fe: &Frontend,
    text: &str,
    images: &[ChatImage],
) -> Result<MultimodalPrompt, ApiError> {
    if images.is_empty() {
        // Text alone is checked against the context where every prompt is (`submit.rs`).
        return tokenize_images(fe, text, images, None);
    }
    let n_ctx = app
        .handle
        .info()
        .ok_or_else(|| ApiError::unavailable("Loading model"))?
        .n_ctx_slot;
    tokenize_images(fe, text, images, Some(n_ctx))
}

/// The request's prompt of `n_prompt` tokens (`image_rows` of them for `n_images` images) does
/// not leave a slot of `n_ctx` tokens room for one more: llama-server's
/// `exceed_context_size_error`.
pub(crate) fn exceeds_context(
    n_prompt: usize,
    image_rows: usize,
    n_images: usize,
    n_ctx: usize,
) -> ApiError {
    let of_images = match n_images {
        0 => String::new(),
        k => format!(" ({image_rows} of them for {k} image(s))"),
    };
    let mut e = ApiError::new(
        StatusCode::BAD_REQUEST,
        "exceed_context_size_error",
        format!(
            "the request exceeds the available context size: the prompt has {n_prompt} tokens{of_images} and a slot holds {n_ctx} (at least one more is needed to generate)"
        ),
    );
    e.extra = Some(Box::new(
        json!({"n_prompt_tokens": n_prompt, "n_ctx": n_ctx}),
    ));
    e
}

/// The prompt of `text` and `images`; with `n_ctx`, its length (image rows from the images'
/// headers) is checked against it before any image is decoded.
fn tokenize_images(
    fe: &Frontend,
    text: &str,
    images: &[ChatImage],
    n_ctx: Option<usize>,
) -> Result<MultimodalPrompt, ApiError> {
    let Some((vision, text)) = prompt_text(fe, text, images)? else {
        return Ok(MultimodalPrompt {
            tokens: fe.tokenizer.encode(text, true),
            images: Vec::new(),
        });
    };
    if let Some(n_ctx) = n_ctx {
        let image_rows = header_rows(vision, images)?;
        let n_prompt = text.n_text_tokens() + image_rows;
        if n_prompt >= n_ctx {
            return Err(exceeds_context(n_prompt, image_rows, images.len(), n_ctx));
        }
    }
    let inputs = images
        .iter()
        .map(|im| {
            decode_image(im.bytes()?, &im.field)
                .map(|rgb| ImageInput::new(vision, &rgb))
                .map_err(|e| ApiError::invalid_field(&im.field, e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    text.with_images(inputs)
        .map_err(|e| ApiError::internal(e.to_string()))
}

/// The text of a prompt with images, tokenized around their placeholders, and the tower that
/// reads them; `None` for a prompt without images.
fn prompt_text<'f>(
    fe: &'f Frontend,
    text: &str,
    images: &[ChatImage],
) -> Result<Option<(&'f VisionTower, PromptText)>, ApiError> {
    let Some(first) = images.first() else {
        return Ok(None);
    };
    let Some(vision) = fe.vision.as_deref() else {
        return Err(ApiError::invalid_field(
            &first.field,
            "the request has an image, but this server has no vision tower: start it with --mmproj FILE",
        ));
    };
    let text = PromptText::tokenize(&fe.tokenizer, text, true, images.len()).map_err(|e| {
        ApiError::bad_request(format!(
            "{e}: the text of the messages must not contain the placeholder itself"
        ))
    })?;
    Ok(Some((vision, text)))
}

/// The prompt rows of `images`, from the sizes their headers declare (no pixel is decoded).
fn header_rows(vision: &VisionTower, images: &[ChatImage]) -> Result<usize, ApiError> {
    let mut rows = 0;
    for im in images {
        let (w, h) = image_size(im.bytes()?, &im.field)
            .map_err(|e| ApiError::invalid_field(&im.field, e.to_string()))?;
        let (nx, ny) = vision.token_grid_for_size(w, h);
        rows += nx * ny;
    }
    Ok(rows)
}

/// `grammar` with the request's reasoning budget (its `thinking_budget_tokens`, else the server's
/// `--reasoning-budget`) when the output can reason: the prompt opened a block (`in_reasoning`)
/// or the model may open one (`may_open`).
pub(crate) fn with_reasoning_budget(
    app: &App,
    fe: &Frontend,
    grammar: Option<Constraint>,
    requested: Option<Option<usize>>,
    in_reasoning: bool,
    may_open: bool,
) -> Result<Option<Constraint>, ApiError> {
    let Some(budget) = requested.unwrap_or(app.cfg.reasoning_budget) else {
        return Ok(grammar);
    };
    if !in_reasoning && !may_open {
        return Ok(grammar);
    }
    let budget = ReasoningBudget::from_tags(
        &fe.tokenizer,
        budget,
        in_reasoning,
        reasoning::OPEN,
        reasoning::CLOSE,
        &app.cfg.reasoning_budget_message,
    );
    Ok(Some(match grammar {
        Some(g) => g.with_reasoning_budget(budget),
        None => fe
            .grammars()
            .map_err(ApiError::internal)?
            .reasoning_budget_only(budget),
    }))
}

/// `logit_bias` keys as token ids: ids checked against the vocabulary, texts tokenized (every
/// token of the text gets the bias, as in llama-server).
pub(crate) fn resolve_bias(fe: &Frontend, params: &mut GenParams) -> Result<(), ApiError> {
    let mut bias = Vec::new();
    for (key, b) in &params.logit_bias {
        match key {
            BiasKey::Id(id) if *id < fe.n_vocab as u64 => bias.push((*id as u32, *b)),
            BiasKey::Id(id) => {
                return Err(ApiError::invalid_field(
                    "logit_bias",
                    format!(
                        "token id {id} is out of range: the vocabulary has {} tokens",
                        fe.n_vocab
                    ),
                ))
            }
            BiasKey::Text(t) => {
                bias.extend(fe.tokenizer.encode(t, false).into_iter().map(|id| (id, *b)))
            }
        }
    }
    params.sampler.logit_bias = bias;
    Ok(())
}

/// A chat request as what the scheduler runs: the messages through the template, the grammar
/// for `tool_choice` or the output format, and how the answer is cut into reasoning, content and
/// tool calls.
pub(crate) fn prepare_chat(
    app: &App,
    fe: &Frontend,
    mut req: ChatRequest,
) -> Result<Prepared, ApiError> {
    // Any model name is accepted, as llama-server does: clients hard-code names.
    resolve_bias(fe, &mut req.params)?;
    let use_tools = uses_tools(&req);
    let text = render_chat(app, fe, &req)?;
    let MultimodalPrompt { tokens, images } = tokenize_within_context(app, fe, &text, &req.images)?;
    let cache_points: Vec<usize> = final_header(&fe.tokenizer, &tokens).into_iter().collect();
    let in_reasoning = prompt_opens_thinking(&text);
    let reasoning = req.params.reasoning.unwrap_or(app.cfg.reasoning);
    let grammar = match (&req.tool_choice, &req.params.grammar) {
        (ToolChoice::Required | ToolChoice::Named(_), _) if use_tools => {
            let only = match &req.tool_choice {
                ToolChoice::Named(n) => Some(n.as_str()),
                _ => None,
            };
            let reasoning = if in_reasoning {
                Reasoning::Open
            } else if fe.template.source().contains("<think>") {
                Reasoning::Optional
            } else {
                Reasoning::None
            };
            let lark = call_grammar(
                &req.tools,
                only,
                fe.tool_format,
                // A named tool is called once; `required` may call several.
                only.is_none() && req.parallel_tool_calls && !req.legacy_functions,
                reasoning,
            );
            Some(compile(
                fe,
                &GrammarSource::Grammar(lark),
                &req.tool_choice_field,
            )?)
        }
        (_, Some(g)) => Some(compile(fe, g, &req.params.grammar_field)?),
        _ => None,
    };
    let grammar = with_reasoning_budget(
        app,
        fe,
        grammar,
        req.params.reasoning_budget,
        in_reasoning,
        fe.template.source().contains(reasoning::OPEN),
    )?;
    let shaping = Shaping {
        splitter: match reasoning {
            ReasoningFormat::Deepseek => Some(ReasoningSplitter::new(in_reasoning)),
            ReasoningFormat::None => None,
        },
        tools: use_tools.then(|| {
            ToolCallParser::new(
                req.tools.clone(),
                (!req.parallel_tool_calls || req.legacy_functions).then_some(1),
            )
        }),
        legacy_functions: req.legacy_functions,
        logprobs: req.params.logprobs.is_some(),
        return_tokens: req.params.return_tokens,
        native: None,
    };
    Ok(Prepared {
        params: req.params,
        tokens,
        images,
        cache_points,
        grammar,
        shaping,
    })
}

/// The prompt tokens a chat request would run (`count_tokens`, `input_tokens`): its messages
/// through the template, images by the rows they take.
pub(crate) fn count_chat_tokens(
    app: &App,
    fe: &Frontend,
    req: ChatRequest,
) -> Result<usize, ApiError> {
    let text = render_chat(app, fe, &req)?;
    // Images count by their headers: nothing is decoded to be counted.
    Ok(match prompt_text(fe, &text, &req.images)? {
        None => fe.tokenizer.encode(&text, true).len(),
        Some((vision, text)) => text.n_text_tokens() + header_rows(vision, &req.images)?,
    })
}
