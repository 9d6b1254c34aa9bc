//! Images given as `http://` / `https://` URLs, fetched where the server is started with
//! `--allow-image-urls`, within the limits a remote fetch needs (llama-server's are 10 MB and
//! 10 s): a byte cap checked against `Content-Length` before the body is read and against the
//! bytes actually received, a time limit on the whole fetch (connect, redirects, headers and
//! body), at most [`MAX_REDIRECTS`] redirects and only to http(s).
//!
//! The request parser (synchronous, on a blocking thread) keeps such an image as
//! [`ImageSource::Remote`]; the handler fetches every one with [`fetch_images`] on the async
//! runtime before it prepares the prompt and submits it, so that neither the scheduler's thread
//! nor a runtime worker ever waits on the network. The fetched bytes then go through the same
//! decoding and checks as a data URI's.

use std::time::Duration;

use futures_util::StreamExt as _;
use reqwest::redirect::{Attempt, Policy};
use reqwest::Url;

use crate::error::ApiError;
use crate::request::{ChatImage, ImageSource};
use crate::{App, Frontend};

/// `--image-url-max-bytes`' default: 10 MiB, llama-server's cap on a fetched image.
pub const DEFAULT_MAX_BYTES: u64 = 10 << 20;
/// `--image-url-timeout`'s default, llama-server's.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// Redirects followed per image URL (browsers allow 20, curl's default 50; an image host needs
/// one or two).
pub const MAX_REDIRECTS: usize = 5;
/// Image URLs of one request fetched at once: enough that a few pictures do not wait on each
/// other, few enough that one request cannot open hundreds of connections.
const CONCURRENT_FETCHES: usize = 4;

const USER_AGENT: &str = concat!("nextn/", env!("CARGO_PKG_VERSION"));

/// How image URLs are fetched (`--image-url-max-bytes`, `--image-url-timeout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageUrlLimits {
    /// Largest image body accepted, in bytes.
    pub max_bytes: u64,
    /// Time for the whole fetch of one image: connecting, redirects, headers and body.
    pub timeout: Duration,
}

impl Default for ImageUrlLimits {
    fn default() -> Self {
        ImageUrlLimits {
            max_bytes: DEFAULT_MAX_BYTES,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

/// Why an image URL gave no image; each becomes a 400 naming the request field.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("the fetch took longer than {} s", .0.as_secs_f64())]
    Timeout(Duration),
    #[error("the image URL answered HTTP {0}")]
    Status(reqwest::StatusCode),
    #[error("the image is larger than {limit} bytes (its Content-Length is {length})")]
    DeclaredTooLarge { length: u64, limit: u64 },
    #[error("the image is larger than {limit} bytes")]
    TooLarge { limit: u64 },
    #[error("{0}")]
    Redirect(RedirectRefused),
    #[error("cannot connect: {0}")]
    Connect(String),
    #[error("{0}")]
    Transfer(String),
}

/// A redirect the fetch does not follow.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RedirectRefused {
    #[error("more than {MAX_REDIRECTS} redirects")]
    TooMany,
    #[error("a redirect to a '{0}:' URL (only http:// and https:// are fetched)")]
    Scheme(String),
}

/// Whether to follow a redirect to `next` after `previous` URLs (the first being the one the
/// request named, so the redirects so far are `previous - 1`).
pub fn check_redirect(previous: usize, next: &Url) -> Result<(), RedirectRefused> {
    if previous > MAX_REDIRECTS {
        return Err(RedirectRefused::TooMany);
    }
    check_redirect_scheme(next)
}

fn check_redirect_scheme(next: &Url) -> Result<(), RedirectRefused> {
    match next.scheme() {
        "http" | "https" => Ok(()),
        other => Err(RedirectRefused::Scheme(other.to_string())),
    }
}

/// Why a redirect came back as the answer: the client does not hand a redirect to a URL it
/// cannot fetch (`file:`, `ftp:`, ...) to the policy, it returns the 3xx itself.
fn unfollowed_redirect(response: &reqwest::Response) -> Option<RedirectRefused> {
    let location = response
        .headers()
        .get(reqwest::header::LOCATION)?
        .to_str()
        .ok()?;
    let next = response.url().join(location).ok()?;
    check_redirect_scheme(&next).err()
}

/// Refuses a body whose `Content-Length` is over the cap before any of it is read.
pub fn check_declared_length(length: Option<u64>, limit: u64) -> Result<(), FetchError> {
    match length {
        Some(length) if length > limit => Err(FetchError::DeclaredTooLarge { length, limit }),
        _ => Ok(()),
    }
}

/// A body gathered chunk by chunk and cut at the cap, whatever its `Content-Length` said (or
/// whether it had one: chunked bodies have none).
pub struct CappedBody {
    bytes: Vec<u8>,
    limit: u64,
}

impl CappedBody {
    /// `expected` (a `Content-Length` within the cap) only sizes the first allocation.
    pub fn new(limit: u64, expected: Option<u64>) -> Self {
        let reserve = expected.unwrap_or(0).min(limit).min(1 << 20);
        CappedBody {
            bytes: Vec::with_capacity(usize::try_from(reserve).unwrap_or(0)),
            limit,
        }
    }

    pub fn push(&mut self, chunk: &[u8]) -> Result<(), FetchError> {
        let total = self.bytes.len() as u64 + chunk.len() as u64;
        if total > self.limit {
            return Err(FetchError::TooLarge { limit: self.limit });
        }
        self.bytes.extend_from_slice(chunk);
        Ok(())
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }
}

/// The HTTP client and limits of a server started with `--allow-image-urls`.
pub(crate) struct ImageFetcher {
    client: reqwest::Client,
    limits: ImageUrlLimits,
}

impl ImageFetcher {
    pub(crate) fn new(limits: ImageUrlLimits) -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder()
            .user_agent(USER_AGENT)
            .redirect(Policy::custom(|attempt: Attempt| {
                match check_redirect(attempt.previous().len(), attempt.url()) {
                    Ok(()) => attempt.follow(),
                    Err(e) => attempt.error(e),
                }
            }))
            // The URL a request named is its own business: it is not passed on to other hosts.
            .referer(false)
            // Fetched directly, as llama-server does: proxy variables in the server's environment
            // are there for its own downloads (-hf), not for what clients ask it to fetch.
            .no_proxy()
            .build()?;
        Ok(ImageFetcher { client, limits })
    }

    /// The body at `url`, or why there is none.
    pub(crate) async fn fetch(&self, url: &str) -> Result<Vec<u8>, FetchError> {
        let limit = self.limits.timeout;
        match tokio::time::timeout(limit, self.fetch_unbounded(url)).await {
            Ok(r) => r,
            Err(_) => Err(FetchError::Timeout(limit)),
        }
    }

    async fn fetch_unbounded(&self, url: &str) -> Result<Vec<u8>, FetchError> {
        let mut response = self.client.get(url).send().await.map_err(transfer_error)?;
        let status = response.status();
        if !status.is_success() {
            return Err(match unfollowed_redirect(&response) {
                Some(r) if status.is_redirection() => FetchError::Redirect(r),
                _ => FetchError::Status(status),
            });
        }
        let max = self.limits.max_bytes;
        check_declared_length(response.content_length(), max)?;
        let mut body = CappedBody::new(max, response.content_length());
        while let Some(chunk) = response.chunk().await.map_err(transfer_error)? {
            body.push(&chunk)?;
        }
        Ok(body.into_bytes())
    }
}

/// A client error as this server says it: a refused redirect by its reason, a connection error
/// with its cause (the URL left out: the request field names the image).
fn transfer_error(e: reqwest::Error) -> FetchError {
    let mut source = std::error::Error::source(&e);
    let mut causes = Vec::new();
    while let Some(s) = source {
        if let Some(r) = s.downcast_ref::<RedirectRefused>() {
            return FetchError::Redirect(r.clone());
        }
        let text = s.to_string();
        // hyper and hyper-util repeat their cause in their own message at times.
        if causes.last() != Some(&text) {
            causes.push(text);
        }
        source = s.source();
    }
    let connect = e.is_connect();
    if connect {
        // The causes say it ("tcp connect error: Connection refused", "dns error: ...", a TLS
        // alert); the wrappers' "error sending request" and "client error (Connect)" add nothing.
        let said: Vec<String> = causes
            .iter()
            .filter(|c| !c.starts_with("client error"))
            .cloned()
            .collect();
        if !said.is_empty() {
            return FetchError::Connect(said.join(": "));
        }
    }
    let mut text = e.without_url().to_string();
    for c in causes {
        text.push_str(": ");
        text.push_str(&c);
    }
    if connect {
        FetchError::Connect(text)
    } else {
        FetchError::Transfer(text)
    }
}

/// The 400 for an image URL on a server that does not fetch them.
pub fn not_allowed(field: &str) -> ApiError {
    ApiError::invalid_field(
        field,
        format!(
            "{field}: image URLs are not fetched by this server unless it is started with --allow-image-urls: send the image inline as a data URI (data:image/png;base64,...)"
        ),
    )
}

/// The 400 for an image URL that gave no image.
pub fn fetch_failed(field: &str, e: &FetchError) -> ApiError {
    ApiError::invalid_field(field, format!("{field}: cannot fetch the image: {e}"))
}

/// Refuses a request's image URLs on a server without `--allow-image-urls` (for endpoints that
/// never need the images' bytes, such as `/apply-template`).
pub(crate) fn check_allowed(app: &App, images: &[ChatImage]) -> Result<(), ApiError> {
    match images.iter().find(|im| im.remote_url().is_some()) {
        Some(im) if app.image_fetcher.is_none() => Err(not_allowed(&im.field)),
        _ => Ok(()),
    }
}

/// Fetches every image of `images` still behind a URL, in place; the first that fails (in the
/// request's order) is the answer. Up to [`CONCURRENT_FETCHES`] are fetched at once, each within
/// its own time limit.
pub(crate) async fn fetch_images(
    app: &App,
    fe: &Frontend,
    images: &mut [ChatImage],
) -> Result<(), ApiError> {
    if images.iter().all(|im| im.remote_url().is_none()) {
        return Ok(());
    }
    // Without a vision tower every image is refused when the prompt is prepared (naming
    // --mmproj): nothing is worth fetching.
    if fe.vision.is_none() {
        return Ok(());
    }
    check_allowed(app, images)?;
    let Some(fetcher) = app.image_fetcher.as_ref() else {
        return Ok(());
    };
    let wanted: Vec<(usize, String)> = images
        .iter()
        .enumerate()
        .filter_map(|(k, im)| im.remote_url().map(|u| (k, u.to_string())))
        .collect();
    // `buffered` yields in order: the first failure in the request's order ends the others.
    let mut fetched = futures_util::stream::iter(wanted)
        .map(|(k, url)| async move { (k, fetcher.fetch(&url).await) })
        .buffered(CONCURRENT_FETCHES);
    while let Some((k, result)) = fetched.next().await {
        let image = &mut images[k];
        match result {
            Ok(bytes) => image.source = ImageSource::Inline(bytes),
            Err(e) => return Err(fetch_failed(&image.field, &e)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(s: &str) -> Url {
        Url::parse(s).unwrap()
    }

    #[test]
    fn redirects_stop_after_five_and_at_other_schemes() {
        let next = url("http://127.0.0.1/a.png");
        // previous = the URL asked for plus the redirects so far.
        for previous in 1..=MAX_REDIRECTS {
            assert_eq!(check_redirect(previous, &next), Ok(()), "{previous}");
        }
        assert_eq!(
            check_redirect(MAX_REDIRECTS + 1, &next),
            Err(RedirectRefused::TooMany)
        );
        assert_eq!(check_redirect(1, &url("https://example.com/b.jpg")), Ok(()));
        for bad in ["file:///etc/passwd", "ftp://example.com/a.png", "data:,x"] {
            let e = check_redirect(1, &url(bad)).unwrap_err();
            assert!(e.to_string().contains("only http:// and https://"), "{e}");
        }
        assert_eq!(
            RedirectRefused::TooMany.to_string(),
            "more than 5 redirects"
        );
    }

    #[test]
    fn a_content_length_over_the_cap_is_refused_before_reading() {
        assert!(check_declared_length(None, 10).is_ok());
        assert!(check_declared_length(Some(10), 10).is_ok());
        let e = check_declared_length(Some(11), 10).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the image is larger than 10 bytes (its Content-Length is 11)"
        );
    }

    #[test]
    fn streamed_bytes_are_counted_against_the_cap() {
        let mut b = CappedBody::new(10, None);
        b.push(b"12345").unwrap();
        b.push(b"67890").unwrap();
        let e = b.push(b"x").unwrap_err();
        assert_eq!(e.to_string(), "the image is larger than 10 bytes");
        assert_eq!(b.into_bytes(), b"1234567890");
        // A single chunk past the cap, however small the Content-Length claimed.
        let mut b = CappedBody::new(4, Some(2));
        assert!(b.push(b"12345").is_err());
        // The allocation is bounded by the cap, not by what the server claims.
        let b = CappedBody::new(8, Some(u64::MAX));
        assert!(b.bytes.capacity() <= 8 + 64);
    }

    #[test]
    fn errors_name_the_field_and_the_problem() {
        let field = "messages[0].content[1].image_url.url";
        let e = not_allowed(field);
        assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        assert_eq!(e.kind, "invalid_request_error");
        assert_eq!(e.param.as_deref(), Some(field));
        assert!(e.message.starts_with(field), "{}", e.message);
        assert!(e.message.contains("--allow-image-urls"), "{}", e.message);
        assert!(e.message.contains("data URI"), "{}", e.message);
        for (err, words) in [
            (
                FetchError::Timeout(Duration::from_secs(10)),
                "took longer than 10 s",
            ),
            (
                FetchError::Timeout(Duration::from_millis(1500)),
                "took longer than 1.5 s",
            ),
            (
                FetchError::Status(reqwest::StatusCode::NOT_FOUND),
                "HTTP 404 Not Found",
            ),
            (
                FetchError::TooLarge { limit: 10485760 },
                "larger than 10485760 bytes",
            ),
            (
                FetchError::Redirect(RedirectRefused::TooMany),
                "more than 5 redirects",
            ),
        ] {
            let e = fetch_failed(field, &err);
            assert_eq!(e.param.as_deref(), Some(field));
            assert!(e.message.starts_with(field), "{}", e.message);
            assert!(e.message.contains(words), "{}", e.message);
        }
    }

    /// A fetch against a port nothing listens on fails as a connection error, quickly, through
    /// the real client.
    #[test]
    fn a_refused_connection_is_a_connect_error() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let f = ImageFetcher::new(ImageUrlLimits::default()).unwrap();
        let e = rt
            .block_on(f.fetch(&format!("http://127.0.0.1:{port}/a.png")))
            .unwrap_err();
        assert!(matches!(e, FetchError::Connect(_)), "{e:?}");
        assert!(e.to_string().starts_with("cannot connect"), "{e}");
        assert!(!e.to_string().contains("127.0.0.1"), "{e}");
    }
}
