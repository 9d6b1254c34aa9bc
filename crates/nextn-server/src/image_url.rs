//! Images given as `http://` / `https://` URLs, fetched where the server is started with
//! `--allow-image-urls`, within the limits a remote fetch needs (llama-server's are 10 MB and
//! 10 s): a byte cap checked against `Content-Length` before the body is read and against the
//! bytes actually received, a time limit on the whole fetch (connect, redirects, headers and
//! body), at most [`MAX_REDIRECTS`] redirects and only to http(s), at most `--image-urls-max`
//! URLs per request.
//!
//! Only public addresses are fetched unless `--image-url-allow-private` allows others
//! ([`address`]). Every hop is checked: an address written in the URL (the request's, or a
//! redirect's `Location`) before anything is sent, and a host name by the client's own resolver,
//! which looks the name up, checks every address it resolves to, and hands the connector exactly
//! those addresses: the connection goes to an address that was checked, with no second lookup in
//! between that a DNS answer with a short lifetime could change (DNS rebinding).
//!
//! What happens on the network is not told to the client: an address that is not public (in
//! the URL, behind its host name, or at a redirect), a failed lookup, a refused connection, a
//! timeout, an HTTP status and a redirect that is not followed all give the same 400
//! ([`NOT_FETCHED`]), so that the server cannot be used to probe which hosts and ports answer
//! where it runs. The cause goes to the server's log, with the URL less its credentials and
//! query. Only the byte cap is named: it is this server's own limit, the one failure a client
//! can do something about (send the picture inline), and it arises only after a host the policy
//! allows has answered.
//!
//! The request parser (synchronous, on a blocking thread) keeps such an image as
//! [`ImageSource::Remote`]; the handler fetches every one with [`fetch_images`] on the async
//! runtime before it prepares the prompt and submits it, so that neither the scheduler's thread
//! nor a runtime worker ever waits on the network. The fetched bytes then go through the same
//! decoding and checks as a data URI's.

pub mod address;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use reqwest::redirect::{Attempt, Policy};
use reqwest::Url;

pub use address::{AddressPolicy, Network, NetworkError, NonPublic};

use crate::error::ApiError;
use crate::request::{ChatImage, ImageSource};
use crate::{App, Frontend};

/// `--image-url-max-bytes`' default: 10 MiB, llama-server's cap on a fetched image.
pub const DEFAULT_MAX_BYTES: u64 = 10 << 20;
/// `--image-url-timeout`'s default, llama-server's.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// `--image-urls-max`' default: more pictures than a chat turn usually carries, few enough that
/// one request holds at most 80 MiB of fetched bodies at the default byte cap.
pub const DEFAULT_MAX_URLS: usize = 8;
/// Redirects followed per image URL (browsers allow 20, curl's default 50; an image host needs
/// one or two).
pub const MAX_REDIRECTS: usize = 5;
/// Image URLs of one request fetched at once: enough that a few pictures do not wait on each
/// other, few enough that one request cannot open hundreds of connections.
const CONCURRENT_FETCHES: usize = 4;

const USER_AGENT: &str = concat!("nextn/", env!("CARGO_PKG_VERSION"));

/// How image URLs are fetched (`--image-url-max-bytes`, `--image-url-timeout`,
/// `--image-urls-max`, `--image-url-allow-private`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageUrlLimits {
    /// Largest image body accepted, in bytes.
    pub max_bytes: u64,
    /// Time for the whole fetch of one image: connecting, redirects, headers and body.
    pub timeout: Duration,
    /// Image URLs one request may carry.
    pub max_urls: usize,
    /// The addresses a fetch may connect to.
    pub addresses: AddressPolicy,
}

impl Default for ImageUrlLimits {
    fn default() -> Self {
        ImageUrlLimits {
            max_bytes: DEFAULT_MAX_BYTES,
            timeout: DEFAULT_TIMEOUT,
            max_urls: DEFAULT_MAX_URLS,
            addresses: AddressPolicy::PublicOnly,
        }
    }
}

/// Why an image URL gave no image, as the server's log says it. [`fetch_failed`] makes the 400,
/// which names only the byte cap.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("{address} is in {range}")]
    NonPublicUrl { address: IpAddr, range: NonPublic },
    #[error("{0}")]
    NonPublicName(NameRefused),
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

/// A host name whose addresses include one the fetch may not connect to.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{host} resolves to {address}, in {range}")]
pub struct NameRefused {
    pub host: String,
    pub address: IpAddr,
    pub range: NonPublic,
}

/// A redirect the fetch does not follow.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RedirectRefused {
    #[error("more than {MAX_REDIRECTS} redirects")]
    TooMany,
    #[error("a redirect to a '{0}:' URL (only http:// and https:// are fetched)")]
    Scheme(String),
    #[error("a redirect to {address}, in {range}")]
    NonPublic { address: IpAddr, range: NonPublic },
}

/// The address a URL names as its host, if it names one rather than a host name. The URL parser
/// has already turned every IPv4 form (`2130706433`, `0x7f.1`) into dotted decimal for http(s),
/// and writes IPv6 hosts in brackets.
fn url_address(url: &Url) -> Option<IpAddr> {
    let host = url.host_str()?;
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    bare.parse().ok()
}

/// Whether to follow a redirect to `next` after `previous` URLs (the first being the one the
/// request named, so the redirects so far are `previous - 1`), under `addresses`.
pub fn check_redirect(
    previous: usize,
    next: &Url,
    addresses: &AddressPolicy,
) -> Result<(), RedirectRefused> {
    if previous > MAX_REDIRECTS {
        return Err(RedirectRefused::TooMany);
    }
    check_redirect_scheme(next)?;
    match url_address(next) {
        Some(address) => addresses
            .check(address)
            .map_err(|range| RedirectRefused::NonPublic { address, range }),
        None => Ok(()),
    }
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

/// The addresses a host name resolved to, if the policy allows every one of them. One refused
/// address refuses the name: a host that resolves to a public and a private address is not
/// tried on whichever answers, nor on the public one (which a later lookup could no longer
/// give).
pub fn check_resolved(
    host: &str,
    found: Vec<SocketAddr>,
    addresses: &AddressPolicy,
) -> Result<Vec<SocketAddr>, NameRefused> {
    for a in &found {
        if let Err(range) = addresses.check(a.ip()) {
            return Err(NameRefused {
                host: host.to_string(),
                address: a.ip(),
                range,
            });
        }
    }
    Ok(found)
}

/// Where the resolver looks host names up.
#[derive(Clone)]
enum Lookup {
    /// The system's resolver (`getaddrinfo`: the hosts file, then DNS).
    System,
    /// Names answered by a function, so that tests of names send no DNS query.
    #[cfg(test)]
    Fixed(Arc<FixedNames>),
}

/// A test's answers to host names (`None`: no such name).
#[cfg(test)]
type FixedNames = dyn Fn(&str) -> Option<Vec<IpAddr>> + Send + Sync;

impl Lookup {
    async fn addresses(&self, host: &str) -> std::io::Result<Vec<SocketAddr>> {
        match self {
            // Port 0: the connector puts the URL's port on each address.
            Lookup::System => Ok(tokio::net::lookup_host((host, 0)).await?.collect()),
            #[cfg(test)]
            Lookup::Fixed(answer) => answer(host)
                .map(|ips| ips.into_iter().map(|ip| SocketAddr::new(ip, 0)).collect())
                .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no such name")),
        }
    }
}

/// The HTTP client's resolver: the lookup, then every address checked against the policy. The
/// connector connects only to the addresses returned here, so what was checked is what is
/// reached: there is no second lookup whose answer could differ (DNS rebinding).
struct CheckedResolver {
    addresses: Arc<AddressPolicy>,
    lookup: Lookup,
}

impl Resolve for CheckedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let addresses = self.addresses.clone();
        let lookup = self.lookup.clone();
        let host = name.as_str().to_string();
        Box::pin(async move {
            let found = lookup.addresses(&host).await?;
            let checked = check_resolved(&host, found, &addresses)?;
            let addrs: Addrs = Box::new(checked.into_iter());
            Ok(addrs)
        })
    }
}

/// The HTTP client and limits of a server started with `--allow-image-urls`.
pub(crate) struct ImageFetcher {
    client: reqwest::Client,
    limits: ImageUrlLimits,
}

impl ImageFetcher {
    pub(crate) fn new(limits: ImageUrlLimits) -> Result<Self, reqwest::Error> {
        Self::with_lookup(limits, Lookup::System)
    }

    fn with_lookup(limits: ImageUrlLimits, lookup: Lookup) -> Result<Self, reqwest::Error> {
        let addresses = Arc::new(limits.addresses.clone());
        let redirect_addresses = addresses.clone();
        let client = reqwest::Client::builder()
            .user_agent(USER_AGENT)
            .redirect(Policy::custom(
                move |attempt: Attempt| match check_redirect(
                    attempt.previous().len(),
                    attempt.url(),
                    &redirect_addresses,
                ) {
                    Ok(()) => attempt.follow(),
                    Err(e) => attempt.error(e),
                },
            ))
            .dns_resolver(Arc::new(CheckedResolver { addresses, lookup }))
            // The URL a request named is its own business: it is not passed on to other hosts.
            .referer(false)
            // Fetched directly, as llama-server does: proxy variables in the server's environment
            // are there for its own downloads (-hf), not for what clients ask it to fetch; and a
            // proxy would connect to addresses this server never checked.
            .no_proxy()
            .build()?;
        Ok(ImageFetcher { client, limits })
    }

    /// The body at `url`, or why there is none.
    pub(crate) async fn fetch(&self, url: &str) -> Result<Vec<u8>, FetchError> {
        let url = Url::parse(url).map_err(|e| FetchError::Transfer(format!("not a URL: {e}")))?;
        if let Some(address) = url_address(&url) {
            self.limits
                .addresses
                .check(address)
                .map_err(|range| FetchError::NonPublicUrl { address, range })?;
        }
        let limit = self.limits.timeout;
        match tokio::time::timeout(limit, self.fetch_unbounded(url)).await {
            Ok(r) => r,
            Err(_) => Err(FetchError::Timeout(limit)),
        }
    }

    async fn fetch_unbounded(&self, url: Url) -> Result<Vec<u8>, FetchError> {
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

/// A client error as this server logs it: a refused redirect or host name by its reason, a
/// connection error with its cause (the URL left out: the log line names it once).
fn transfer_error(e: reqwest::Error) -> FetchError {
    let mut source = std::error::Error::source(&e);
    let mut causes = Vec::new();
    while let Some(s) = source {
        if let Some(r) = s.downcast_ref::<RedirectRefused>() {
            return FetchError::Redirect(r.clone());
        }
        if let Some(r) = s.downcast_ref::<NameRefused>() {
            return FetchError::NonPublicName(r.clone());
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

/// What a client is told about every fetch that failed, whatever the cause: an address that is
/// not public (in the URL, behind its host name, or at a redirect), a failed lookup, a refused
/// connection, a timeout, an HTTP status, a redirect that is not followed. Telling them apart
/// would let a client map which hosts and ports answer where the server runs; the server's log
/// says which it was.
pub const NOT_FETCHED: &str = "the image could not be fetched: its host was not reached or not allowed (only public addresses are fetched, at every redirect too, unless the server is started with --image-url-allow-private), or it answered with an error status or a redirect that is not followed, or not in time; the server's log says which";

/// The 400 for an image URL that gave no image: one message for every failure on the network
/// ([`NOT_FETCHED`]); only the byte cap, a limit of this server's own, is named.
pub fn fetch_failed(field: &str, e: &FetchError) -> ApiError {
    let message = match e {
        FetchError::DeclaredTooLarge { limit, .. } | FetchError::TooLarge { limit } => format!(
            "{field}: cannot fetch the image: it is larger than {limit} bytes (--image-url-max-bytes)"
        ),
        _ => format!("{field}: {NOT_FETCHED}"),
    };
    ApiError::invalid_field(field, message)
}

/// The 400 for a request with more image URLs than the server fetches for one request.
pub fn too_many_urls(field: &str, max_urls: usize) -> ApiError {
    ApiError::invalid_field(
        field,
        format!(
            "{field}: more than {max_urls} image URLs in one request (--image-urls-max {max_urls}): send the others inline as data URIs"
        ),
    )
}

/// A URL as the server's log shows it: without credentials, query or fragment, which may carry
/// tokens (signed URLs).
fn url_for_log(url: &str) -> String {
    match Url::parse(url) {
        Ok(mut u) => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.set_query(None);
            u.set_fragment(None);
            u.to_string()
        }
        Err(_) => "(not a URL)".into(),
    }
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
/// its own time limit; a request with more than `--image-urls-max` URLs fetches none.
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
    let max_urls = fetcher.limits.max_urls;
    if let Some(&(k, _)) = wanted.get(max_urls) {
        return Err(too_many_urls(&images[k].field, max_urls));
    }
    // `buffered` yields in order: the first failure in the request's order ends the others.
    let mut fetched = futures_util::stream::iter(wanted)
        .map(|(k, url)| async move {
            let result = fetcher.fetch(&url).await;
            (k, url, result)
        })
        .buffered(CONCURRENT_FETCHES);
    while let Some((k, url, result)) = fetched.next().await {
        let image = &mut images[k];
        match result {
            Ok(bytes) => image.source = ImageSource::Inline(bytes),
            Err(e) => {
                // The client's 400 says the same for every cause; the operator sees which.
                if app.cfg.log_requests {
                    eprintln!(
                        "{}: image URL {} not fetched: {e}",
                        image.field,
                        url_for_log(&url)
                    );
                }
                return Err(fetch_failed(&image.field, &e));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpListener;

    use super::*;

    fn url(s: &str) -> Url {
        Url::parse(s).unwrap()
    }

    #[test]
    fn redirects_stop_after_five_at_other_schemes_and_at_non_public_addresses() {
        let any = AddressPolicy::Any;
        let next = url("http://127.0.0.1/a.png");
        // previous = the URL asked for plus the redirects so far.
        for previous in 1..=MAX_REDIRECTS {
            assert_eq!(check_redirect(previous, &next, &any), Ok(()), "{previous}");
        }
        assert_eq!(
            check_redirect(MAX_REDIRECTS + 1, &next, &any),
            Err(RedirectRefused::TooMany)
        );
        assert_eq!(
            check_redirect(1, &url("https://example.com/b.jpg"), &any),
            Ok(())
        );
        for bad in ["file:///etc/passwd", "ftp://example.com/a.png", "data:,x"] {
            let e = check_redirect(1, &url(bad), &any).unwrap_err();
            assert!(e.to_string().contains("only http:// and https://"), "{e}");
        }
        assert_eq!(
            RedirectRefused::TooMany.to_string(),
            "more than 5 redirects"
        );
        let strict = AddressPolicy::PublicOnly;
        // Every way of writing a non-public address in a URL reaches the check.
        for (to, address) in [
            ("http://127.0.0.1/a.png", "127.0.0.1"),
            ("http://2130706433/a.png", "127.0.0.1"),
            ("http://0x7f.1/a.png", "127.0.0.1"),
            ("http://127.1/a.png", "127.0.0.1"),
            (
                "https://169.254.169.254/latest/meta-data/",
                "169.254.169.254",
            ),
            ("http://[::1]:8080/a.png", "::1"),
            ("http://[::ffff:127.0.0.1]/a.png", "::ffff:127.0.0.1"),
            ("http://[::ffff:7f00:1]/a.png", "::ffff:127.0.0.1"),
            ("http://[fe80::1]/a.png", "fe80::1"),
            ("http://10.0.0.1:9000/a.png", "10.0.0.1"),
        ] {
            match check_redirect(1, &url(to), &strict) {
                Err(RedirectRefused::NonPublic { address: a, .. }) => {
                    assert_eq!(a, address.parse::<IpAddr>().unwrap(), "{to}")
                }
                other => panic!("{to}: {other:?}"),
            }
        }
        let e = check_redirect(1, &url("http://127.0.0.2/"), &strict).unwrap_err();
        assert_eq!(
            e.to_string(),
            "a redirect to 127.0.0.2, in 127.0.0.0/8 (loopback)"
        );
        // Names are checked by the resolver, when they are looked up.
        assert_eq!(
            check_redirect(1, &url("http://images.example/a.png"), &strict),
            Ok(())
        );
        assert_eq!(
            check_redirect(1, &url("http://8.8.8.8/a.png"), &strict),
            Ok(())
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
    fn errors_name_the_field_and_tell_nothing_learnt_on_the_network() {
        let field = "messages[0].content[1].image_url.url";
        let e = not_allowed(field);
        assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        assert_eq!(e.kind, "invalid_request_error");
        assert_eq!(e.param.as_deref(), Some(field));
        assert!(e.message.starts_with(field), "{}", e.message);
        assert!(e.message.contains("--allow-image-urls"), "{}", e.message);
        assert!(e.message.contains("data URI"), "{}", e.message);
        let loopback = NonPublic {
            range: "127.0.0.0/8",
            kind: "loopback",
            carried_by: None,
        };
        let generic = format!("{field}: {NOT_FETCHED}");
        for err in [
            FetchError::Timeout(Duration::from_secs(10)),
            FetchError::Status(reqwest::StatusCode::NOT_FOUND),
            FetchError::Status(reqwest::StatusCode::UNAUTHORIZED),
            FetchError::Redirect(RedirectRefused::TooMany),
            FetchError::Redirect(RedirectRefused::Scheme("file".into())),
            FetchError::Redirect(RedirectRefused::NonPublic {
                address: "127.0.0.2".parse().unwrap(),
                range: loopback,
            }),
            FetchError::NonPublicUrl {
                address: "127.0.0.1".parse().unwrap(),
                range: loopback,
            },
            FetchError::NonPublicName(NameRefused {
                host: "intranet.example".into(),
                address: "10.1.2.3".parse().unwrap(),
                range: loopback,
            }),
            FetchError::Connect("tcp connect error: Connection refused".into()),
            FetchError::Connect("dns error: failed to lookup address information".into()),
            FetchError::Transfer("error decoding response body".into()),
        ] {
            let e = fetch_failed(field, &err);
            assert_eq!(e.param.as_deref(), Some(field));
            assert_eq!(e.message, generic, "{err}");
        }
        for (err, words) in [
            (
                FetchError::TooLarge { limit: 10485760 },
                "larger than 10485760 bytes (--image-url-max-bytes)",
            ),
            (
                FetchError::DeclaredTooLarge {
                    length: 99999999,
                    limit: 10485760,
                },
                "larger than 10485760 bytes (--image-url-max-bytes)",
            ),
        ] {
            let e = fetch_failed(field, &err);
            assert_eq!(e.param.as_deref(), Some(field));
            assert!(e.message.starts_with(field), "{}", e.message);
            assert!(e.message.contains(words), "{}", e.message);
        }
        // The length a remote server declared is the log's, not the client's.
        let e = fetch_failed(
            field,
            &FetchError::DeclaredTooLarge {
                length: 99999999,
                limit: 10,
            },
        );
        assert!(!e.message.contains("99999999"), "{}", e.message);
        let e = too_many_urls("messages[0].content[9].image_url.url", 8);
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].content[9].image_url.url")
        );
        assert!(
            e.message.contains("more than 8 image URLs") && e.message.contains("--image-urls-max"),
            "{}",
            e.message
        );
    }

    #[test]
    fn logged_urls_lose_their_credentials_and_query() {
        assert_eq!(
            url_for_log("https://user:secret@img.example/a.png?sig=abc#x"),
            "https://img.example/a.png"
        );
        assert_eq!(
            url_for_log("http://127.0.0.1:8080/a.png"),
            "http://127.0.0.1:8080/a.png"
        );
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    fn fetcher(addresses: AddressPolicy) -> ImageFetcher {
        ImageFetcher::new(ImageUrlLimits {
            timeout: Duration::from_secs(5),
            addresses,
            ..ImageUrlLimits::default()
        })
        .unwrap()
    }

    /// A loopback listener nothing accepts on: a connection attempt would still complete in its
    /// backlog, so an empty backlog afterwards shows that none was made.
    fn untouched_listener(ip: &str) -> TcpListener {
        TcpListener::bind((ip, 0)).unwrap()
    }

    /// Listeners on 127.0.0.1 and 127.0.0.2 at the same port, so that one URL's port reaches
    /// either address.
    fn listeners_on_one_port() -> (TcpListener, TcpListener) {
        for _ in 0..50 {
            let first = TcpListener::bind("127.0.0.1:0").unwrap();
            let port = first.local_addr().unwrap().port();
            if let Ok(second) = TcpListener::bind(("127.0.0.2", port)) {
                return (first, second);
            }
        }
        panic!("no port free on both 127.0.0.1 and 127.0.0.2");
    }

    fn assert_never_connected(l: &TcpListener) {
        l.set_nonblocking(true).unwrap();
        match l.accept() {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            other => panic!("a connection was made: {other:?}"),
        }
    }

    /// A loopback HTTP server answering each request with `answer(path)`.
    fn serve(ip: &str, answer: impl Fn(&str) -> String + Send + 'static) -> SocketAddr {
        serve_on(TcpListener::bind((ip, 0)).unwrap(), answer)
    }

    /// [`serve`] on a listener already bound.
    fn serve_on(l: TcpListener, answer: impl Fn(&str) -> String + Send + 'static) -> SocketAddr {
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for conn in l.incoming() {
                let Ok(mut conn) = conn else { continue };
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).unwrap_or(0) == 1 {
                    head.push(byte[0]);
                }
                let head = String::from_utf8_lossy(&head);
                let path = head.split_whitespace().nth(1).unwrap_or("/");
                let _ = conn.write_all(answer(path).as_bytes());
            }
        });
        addr
    }

    fn ok_body(body: &str) -> String {
        format!(
            "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    }

    /// An address in the URL is checked before anything is sent: no connection is made.
    #[test]
    fn a_non_public_address_in_the_url_is_refused_without_connecting() {
        let rt = runtime();
        let f = fetcher(AddressPolicy::PublicOnly);
        for ip in ["127.0.0.1", "127.0.0.2"] {
            let l = untouched_listener(ip);
            let port = l.local_addr().unwrap().port();
            let e = rt
                .block_on(f.fetch(&format!("http://{ip}:{port}/a.png")))
                .unwrap_err();
            match &e {
                FetchError::NonPublicUrl { address, range } => {
                    assert_eq!(address.to_string(), ip);
                    assert_eq!(range.range, "127.0.0.0/8");
                }
                other => panic!("{other:?}"),
            }
            assert_never_connected(&l);
        }
        // The IPv4-mapped spelling of a loopback address too.
        let l = untouched_listener("127.0.0.1");
        let port = l.local_addr().unwrap().port();
        let e = rt
            .block_on(f.fetch(&format!("http://[::ffff:127.0.0.1]:{port}/a.png")))
            .unwrap_err();
        assert!(matches!(e, FetchError::NonPublicUrl { .. }), "{e:?}");
        assert_never_connected(&l);
    }

    /// A fetcher whose host names are answered by `answer` instead of the system's resolver.
    fn fetcher_with_names(
        addresses: AddressPolicy,
        answer: impl Fn(&str) -> Option<Vec<IpAddr>> + Send + Sync + 'static,
    ) -> ImageFetcher {
        ImageFetcher::with_lookup(
            ImageUrlLimits {
                timeout: Duration::from_secs(5),
                addresses,
                ..ImageUrlLimits::default()
            },
            Lookup::Fixed(Arc::new(answer)),
        )
        .unwrap()
    }

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|a| a.parse().unwrap()).collect()
    }

    #[test]
    fn a_name_is_refused_when_any_of_its_addresses_is() {
        let found = |list: &[&str]| -> Vec<SocketAddr> {
            ips(list)
                .into_iter()
                .map(|ip| SocketAddr::new(ip, 0))
                .collect()
        };
        let strict = AddressPolicy::PublicOnly;
        assert_eq!(
            check_resolved("a.example", found(&["8.8.8.8", "2606:4700::1"]), &strict),
            Ok(found(&["8.8.8.8", "2606:4700::1"]))
        );
        for (list, refused) in [
            (&["8.8.8.8", "10.0.0.1"][..], "10.0.0.1"),
            (&["169.254.169.254"][..], "169.254.169.254"),
            (
                &["2606:4700::1", "::ffff:192.168.0.1"][..],
                "::ffff:192.168.0.1",
            ),
            (&["fd00::1", "8.8.8.8"][..], "fd00::1"),
        ] {
            let e = check_resolved("a.example", found(list), &strict).unwrap_err();
            assert_eq!(e.address.to_string(), refused);
            assert_eq!(e.host, "a.example");
        }
        let e = check_resolved("intranet.example", found(&["10.1.2.3"]), &strict).unwrap_err();
        assert_eq!(
            e.to_string(),
            "intranet.example resolves to 10.1.2.3, in 10.0.0.0/8 (private)"
        );
        let some = AddressPolicy::parse_allowed("10.1.0.0/16").unwrap();
        assert!(check_resolved("intranet.example", found(&["10.1.2.3"]), &some).is_ok());
        assert!(check_resolved("intranet.example", found(&["10.2.0.1"]), &some).is_err());
    }

    /// A host name is looked up by the client's resolver, which refuses it when it resolves to a
    /// non-public address: no connection is made to any of its addresses.
    #[test]
    fn a_name_that_resolves_to_a_non_public_address_is_refused_without_connecting() {
        let rt = runtime();
        let (l1, l2) = listeners_on_one_port();
        let port = l1.local_addr().unwrap().port();
        let names = |host: &str| match host {
            "images.test" => Some(ips(&["127.0.0.1"])),
            "mixed.test" => Some(ips(&["127.0.0.2", "127.0.0.1"])),
            _ => None,
        };
        let e = rt
            .block_on(
                fetcher_with_names(AddressPolicy::PublicOnly, names)
                    .fetch(&format!("http://images.test:{port}/a.png")),
            )
            .unwrap_err();
        match &e {
            FetchError::NonPublicName(r) => {
                assert_eq!(r.host, "images.test");
                assert_eq!(r.address.to_string(), "127.0.0.1");
            }
            other => panic!("{other:?}"),
        }
        // One allowed address among refused ones is not tried either.
        let only_second = AddressPolicy::parse_allowed("127.0.0.2").unwrap();
        let e = rt
            .block_on(
                fetcher_with_names(only_second, names)
                    .fetch(&format!("http://mixed.test:{port}/a.png")),
            )
            .unwrap_err();
        assert!(matches!(e, FetchError::NonPublicName(_)), "{e:?}");
        // A name that does not resolve is a connection error like any other.
        let e = rt
            .block_on(
                fetcher_with_names(AddressPolicy::Any, names)
                    .fetch(&format!("http://nowhere.test:{port}/a.png")),
            )
            .unwrap_err();
        assert!(matches!(e, FetchError::Connect(_)), "{e:?}");
        assert_never_connected(&l1);
        assert_never_connected(&l2);
    }

    /// The connection goes to the address the resolver checked: a name the system cannot resolve
    /// (`.test` is reserved) reaches the server the check allowed; and a name whose answer changes
    /// between lookups (DNS rebinding) is checked at each connection, with the answer that
    /// connection uses.
    #[test]
    fn the_connection_uses_the_checked_address() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let rt = runtime();
        let (first, rebound) = listeners_on_one_port();
        let served = serve_on(first, |_| ok_body("picture"));
        let lookups = Arc::new(AtomicUsize::new(0));
        let counted = lookups.clone();
        // The first answer is the allowed server, every later one an address the policy refuses.
        let f = fetcher_with_names(
            AddressPolicy::parse_allowed("127.0.0.1/32").unwrap(),
            move |host| {
                (host == "rebind.test").then(|| {
                    if counted.fetch_add(1, Ordering::SeqCst) == 0 {
                        ips(&["127.0.0.1"])
                    } else {
                        ips(&["127.0.0.2"])
                    }
                })
            },
        );
        let url = format!("http://rebind.test:{}/a.png", served.port());
        assert_eq!(rt.block_on(f.fetch(&url)).unwrap(), b"picture");
        assert_eq!(lookups.load(Ordering::SeqCst), 1);
        // The server closed the connection (`Connection: close`): the next fetch looks the name
        // up again, gets the refused address, and does not connect.
        let e = rt.block_on(f.fetch(&url)).unwrap_err();
        match &e {
            FetchError::NonPublicName(r) => assert_eq!(r.address.to_string(), "127.0.0.2"),
            other => panic!("{other:?}"),
        }
        assert_eq!(lookups.load(Ordering::SeqCst), 2);
        assert_never_connected(&rebound);
    }

    /// Each redirect is checked as the first URL is: a server the policy allows cannot send the
    /// fetch on to an address it does not.
    #[test]
    fn a_redirect_to_a_non_public_address_is_not_followed() {
        let rt = runtime();
        let refused = untouched_listener("127.0.0.2");
        let refused_port = refused.local_addr().unwrap().port();
        let first = serve("127.0.0.1", move |_| {
            format!("HTTP/1.1 302 Found\r\nConnection: close\r\nLocation: http://127.0.0.2:{refused_port}/a.png\r\nContent-Length: 0\r\n\r\n")
        });
        let only_first = AddressPolicy::parse_allowed("127.0.0.1").unwrap();
        let e = rt
            .block_on(fetcher(only_first).fetch(&format!("http://{first}/a.png")))
            .unwrap_err();
        match &e {
            FetchError::Redirect(RedirectRefused::NonPublic { address, .. }) => {
                assert_eq!(address.to_string(), "127.0.0.2")
            }
            other => panic!("{other:?}"),
        }
        assert_never_connected(&refused);

        let second = serve("127.0.0.2", |_| ok_body("second"));
        let hop = serve("127.0.0.1", move |_| {
            format!("HTTP/1.1 302 Found\r\nConnection: close\r\nLocation: http://{second}/b.png\r\nContent-Length: 0\r\n\r\n")
        });
        let bytes = rt
            .block_on(fetcher(AddressPolicy::Any).fetch(&format!("http://{hop}/a.png")))
            .unwrap();
        assert_eq!(bytes, b"second");
        let both = AddressPolicy::parse_allowed("127.0.0.0/8").unwrap();
        let bytes = rt
            .block_on(fetcher(both).fetch(&format!("http://{hop}/a.png")))
            .unwrap();
        assert_eq!(bytes, b"second");
    }

    /// A fetch against a port nothing listens on fails as a connection error, quickly, through
    /// the real client.
    #[test]
    fn a_refused_connection_is_a_connect_error() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let e = runtime()
            .block_on(fetcher(AddressPolicy::Any).fetch(&format!("http://127.0.0.1:{port}/a.png")))
            .unwrap_err();
        assert!(matches!(e, FetchError::Connect(_)), "{e:?}");
        assert!(e.to_string().starts_with("cannot connect"), "{e}");
        assert!(!e.to_string().contains("127.0.0.1"), "{e}");
    }
}
