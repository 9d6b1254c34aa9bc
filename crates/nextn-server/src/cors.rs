//! CORS for browser front-ends on other origins (`--cors-origins`, `--no-cors-credentials`).
//!
//! A browser lets a page read another origin's answer only when that answer names the page's
//! origin, alone, in `Access-Control-Allow-Origin` (or `*`, which it refuses for requests with
//! credentials). Before a request with an `Authorization` header or a JSON body it sends a
//! preflight `OPTIONS` and needs every header it asked for named in
//! `Access-Control-Allow-Headers`: for a request with credentials `*` is only a header named
//! `*`, and the Fetch standard leaves `Authorization` out of the wildcard in any case. So the
//! request's `Origin` is matched against the configured origins and echoed alone; an origin that
//! is not listed gets no CORS headers (the browser then refuses the answer); a preflight gets
//! the headers it asked for, by name, of those the OpenAI and Anthropic clients send
//! ([`ALLOWED_HEADERS`]); and every answer says `Vary: Origin`, so a cache between a browser and
//! this server does not hand one origin's answer to another.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use reqwest::Url;

use crate::handler::AppState;

/// Request headers a preflight may ask for: what the official OpenAI and Anthropic JavaScript
/// clients send from a browser (their `x-stainless-*` telemetry headers, `anthropic-*` and
/// `openai-*` options, idempotency keys; `user-agent` where the browser lets it be set), the two
/// ways of giving the API key, and the JSON body's content type.
pub const ALLOWED_HEADERS: &[&str] = &[
    "authorization",
    "x-api-key",
    "content-type",
    "accept",
    "user-agent",
    "anthropic-version",
    "anthropic-beta",
    "anthropic-dangerous-direct-browser-access",
    "anthropic-workspace-id",
    "openai-organization",
    "openai-project",
    "openai-beta",
    "idempotency-key",
];

/// Every `x-stainless-*` header is allowed: the clients add new ones from release to release
/// (`x-stainless-retry-count`, `x-stainless-timeout`, `x-stainless-helper-method`, ...).
const ALLOWED_HEADER_PREFIX: &str = "x-stainless-";

/// Methods of this server's routes.
const ALLOWED_METHODS: &str = "GET, POST, DELETE, OPTIONS";

/// How long a browser may keep a preflight's answer (browsers cap it: Chromium at 2 hours,
/// Firefox at 24).
const PREFLIGHT_MAX_AGE_SECS: &str = "600";

/// The origins browsers may call from (`--cors-origins`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum CorsOrigins {
    /// `*`: every origin (the default, as llama-server).
    #[default]
    Any,
    /// A comma-separated list of origins, each `scheme://host[:port]` as browsers send it; the
    /// word `localhost` in the list stands for every origin on this machine's loopback names.
    Listed {
        /// `localhost`, `127.0.0.1` and `[::1]` origins on any port.
        localhost: bool,
        /// Origins as browsers serialize them (lower case, without a default port).
        origins: Vec<String>,
    },
}

/// Why `--cors-origins` was not understood.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CorsOriginsError {
    #[error("--cors-origins: '{0}' is not an origin: give scheme://host[:port], such as https://chat.example or http://localhost:5173 (or `*`, or `localhost`)")]
    NotAnOrigin(String),
    #[error("--cors-origins: '{0}' has a path, query or user name: an origin is scheme://host[:port] only, as browsers send it in the Origin header")]
    NotOnlyAnOrigin(String),
    #[error("--cors-origins: `*` allows every origin, so it cannot be listed with others")]
    AnyInList,
    #[error("--cors-origins: an empty entry in '{0}'")]
    Empty(String),
}

impl CorsOrigins {
    /// `--cors-origins`' value: `*`, or a comma-separated list of origins and `localhost`.
    pub fn parse(value: &str) -> Result<Self, CorsOriginsError> {
        if value.trim() == "*" {
            return Ok(CorsOrigins::Any);
        }
        let mut localhost = false;
        let mut origins = Vec::new();
        for entry in value.split(',').map(str::trim) {
            match entry {
                "" => return Err(CorsOriginsError::Empty(value.to_string())),
                "*" => return Err(CorsOriginsError::AnyInList),
                "localhost" => localhost = true,
                _ => {
                    let origin = serialized_origin(entry)?;
                    if !origins.contains(&origin) {
                        origins.push(origin);
                    }
                }
            }
        }
        Ok(CorsOrigins::Listed { localhost, origins })
    }

    /// Whether a page from `origin` (a request's `Origin` header) may read this server's answers.
    pub fn allows(&self, origin: &str) -> bool {
        match self {
            CorsOrigins::Any => true,
            CorsOrigins::Listed { localhost, origins } => {
                origins.iter().any(|o| o == origin) || (*localhost && is_localhost(origin))
            }
        }
    }

    /// The value for `Access-Control-Allow-Origin` for a request from `origin`, if it is allowed:
    /// the origin itself, or `*` where every origin is allowed without credentials.
    fn allow_origin(&self, origin: &str, credentials: bool) -> Option<HeaderValue> {
        if !self.allows(origin) {
            return None;
        }
        if matches!(self, CorsOrigins::Any) && !credentials {
            return Some(HeaderValue::from_static("*"));
        }
        HeaderValue::from_str(origin).ok()
    }
}

impl std::fmt::Display for CorsOrigins {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CorsOrigins::Any => f.write_str("*"),
            CorsOrigins::Listed { localhost, origins } => {
                let mut all: Vec<&str> = Vec::new();
                if *localhost {
                    all.push("localhost");
                }
                all.extend(origins.iter().map(String::as_str));
                f.write_str(&all.join(","))
            }
        }
    }
}

/// A configured origin as a browser writes it in `Origin`: `HTTPS://Chat.Example:443/` is
/// `https://chat.example`. Schemes without a host name of their own (`chrome-extension://ID`,
/// `tauri://localhost`) are kept as written, in lower case.
fn serialized_origin(entry: &str) -> Result<String, CorsOriginsError> {
    let url = Url::parse(entry).map_err(|_| CorsOriginsError::NotAnOrigin(entry.to_string()))?;
    if url.host_str().is_none_or(str::is_empty) {
        return Err(CorsOriginsError::NotAnOrigin(entry.to_string()));
    }
    let only_origin = matches!(url.path(), "" | "/")
        && url.query().is_none()
        && url.fragment().is_none()
        && url.username().is_empty()
        && url.password().is_none();
    if !only_origin {
        return Err(CorsOriginsError::NotOnlyAnOrigin(entry.to_string()));
    }
    let origin = url.origin();
    if origin.is_tuple() {
        Ok(origin.ascii_serialization())
    } else {
        Ok(entry.trim_end_matches('/').to_ascii_lowercase())
    }
}

/// An `http(s)` origin on this machine's loopback names, on any port.
fn is_localhost(origin: &str) -> bool {
    let Ok(url) = Url::parse(origin) else {
        return false;
    };
    // What a browser sends is its own serialization; anything else is not a browser's origin.
    if !matches!(url.scheme(), "http" | "https") || url.origin().ascii_serialization() != origin {
        return false;
    }
    matches!(url.host_str(), Some("localhost" | "127.0.0.1" | "[::1]"))
}

fn is_allowed_header(name: &str) -> bool {
    ALLOWED_HEADERS.contains(&name)
        || name
            .strip_prefix(ALLOWED_HEADER_PREFIX)
            .is_some_and(|rest| {
                !rest.is_empty()
                    && rest
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            })
}

/// The headers of a preflight's `Access-Control-Request-Headers` this server allows, by name:
/// a browser sends the request only when every header it asked for is in the answer.
fn allowed_request_headers(requested: &HeaderMap) -> Option<HeaderValue> {
    let mut allowed: Vec<String> = Vec::new();
    for value in requested.get_all(header::ACCESS_CONTROL_REQUEST_HEADERS) {
        let Ok(value) = value.to_str() else { continue };
        for name in value.split(',') {
            let name = name.trim().to_ascii_lowercase();
            if is_allowed_header(&name) && !allowed.contains(&name) {
                allowed.push(name);
            }
        }
    }
    if allowed.is_empty() {
        return None;
    }
    HeaderValue::from_str(&allowed.join(", ")).ok()
}

/// The CORS headers of an answer to a request from `origin` (`None`: no `Origin` header).
fn cors_headers(
    origins: &CorsOrigins,
    credentials: bool,
    origin: Option<&str>,
    request: &HeaderMap,
    preflight: bool,
) -> Vec<(HeaderName, HeaderValue)> {
    let mut out = vec![(header::VARY, HeaderValue::from_static("Origin"))];
    if preflight {
        out.push((
            header::VARY,
            HeaderValue::from_static(
                "Access-Control-Request-Method, Access-Control-Request-Headers",
            ),
        ));
    }
    let Some(allow) = origin.and_then(|o| origins.allow_origin(o, credentials)) else {
        return out;
    };
    out.push((header::ACCESS_CONTROL_ALLOW_ORIGIN, allow));
    if credentials {
        out.push((
            header::ACCESS_CONTROL_ALLOW_CREDENTIALS,
            HeaderValue::from_static("true"),
        ));
    }
    if preflight {
        out.push((
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static(ALLOWED_METHODS),
        ));
        if let Some(h) = allowed_request_headers(request) {
            out.push((header::ACCESS_CONTROL_ALLOW_HEADERS, h));
        }
        out.push((
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static(PREFLIGHT_MAX_AGE_SECS),
        ));
        // Chromium's Private Network Access: a page on a public origin asks before calling a
        // server on a private or loopback address; an origin allowed here is allowed there too.
        let private_network = request
            .get("access-control-request-private-network")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
        if private_network {
            out.push((
                HeaderName::from_static("access-control-allow-private-network"),
                HeaderValue::from_static("true"),
            ));
        }
    }
    out
}

/// The CORS layer. A preflight `OPTIONS` (and any other `OPTIONS`) is answered here, before
/// authentication: browsers send no key with it.
pub(crate) async fn layer(State(app): State<AppState>, req: Request, next: Next) -> Response {
    let origin = req
        .headers()
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let is_options = req.method() == Method::OPTIONS;
    let preflight = is_options
        && origin.is_some()
        && req
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    let headers = cors_headers(
        &app.cfg.cors_origins,
        app.cfg.cors_credentials,
        origin.as_deref(),
        req.headers(),
        preflight,
    );
    let mut res = if is_options {
        StatusCode::OK.into_response()
    } else {
        next.run(req).await
    };
    let h = res.headers_mut();
    for (name, value) in headers {
        if name == header::VARY {
            h.append(name, value);
        } else {
            h.insert(name, value);
        }
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed(value: &str) -> CorsOrigins {
        CorsOrigins::parse(value).unwrap()
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    fn get<'a>(out: &'a [(HeaderName, HeaderValue)], name: &str) -> Vec<&'a str> {
        out.iter()
            .filter(|(k, _)| k.as_str() == name)
            .map(|(_, v)| v.to_str().unwrap())
            .collect()
    }

    #[test]
    fn origins_parse_as_browsers_send_them() {
        assert_eq!(listed("*"), CorsOrigins::Any);
        assert_eq!(
            listed(
                "http://a.example, HTTPS://B.Example:443/,http://localhost:5173,http://[::1]:8080"
            ),
            CorsOrigins::Listed {
                localhost: false,
                origins: vec![
                    "http://a.example".into(),
                    "https://b.example".into(),
                    "http://localhost:5173".into(),
                    "http://[::1]:8080".into(),
                ],
            }
        );
        assert_eq!(
            listed("localhost,http://a.example,http://a.example"),
            CorsOrigins::Listed {
                localhost: true,
                origins: vec!["http://a.example".into()],
            }
        );
        assert_eq!(
            listed("chrome-extension://abcdef/"),
            CorsOrigins::Listed {
                localhost: false,
                origins: vec!["chrome-extension://abcdef".into()],
            }
        );
        assert_eq!(
            listed("http://a.example:80,https://b.example").to_string(),
            "http://a.example,https://b.example"
        );
        for (bad, words) in [
            ("a.example", "is not an origin"),
            ("null", "is not an origin"),
            ("http://a.example/app", "has a path"),
            ("http://a.example?x=1", "has a path, query"),
            ("http://user@a.example", "user name"),
            ("*,http://a.example", "cannot be listed"),
            ("http://a.example,", "an empty entry"),
            ("file:///tmp/page.html", "is not an origin"),
        ] {
            let e = CorsOrigins::parse(bad).unwrap_err().to_string();
            assert!(e.starts_with("--cors-origins: "), "{e}");
            assert!(e.contains(words), "{bad}: {e}");
        }
    }

    #[test]
    fn a_listed_origin_is_echoed_alone() {
        let two = listed("http://a.example,http://b.example:8080");
        for origin in ["http://a.example", "http://b.example:8080"] {
            let out = cors_headers(&two, true, Some(origin), &HeaderMap::new(), false);
            assert_eq!(get(&out, "access-control-allow-origin"), [origin]);
            assert_eq!(get(&out, "access-control-allow-credentials"), ["true"]);
            assert_eq!(get(&out, "vary"), ["Origin"]);
        }
        for unlisted in [
            "http://c.example",
            "http://a.example:8080",
            "https://a.example",
            "http://b.example",
            "http://a.example.evil.example",
            "null",
        ] {
            let out = cors_headers(&two, true, Some(unlisted), &HeaderMap::new(), false);
            assert_eq!(get(&out, "access-control-allow-origin"), [] as [&str; 0]);
            assert_eq!(
                get(&out, "access-control-allow-credentials"),
                [] as [&str; 0]
            );
            assert_eq!(get(&out, "vary"), ["Origin"], "{unlisted}");
        }
        // Without credentials the listed origin is still echoed (never `*`), without the flag.
        let out = cors_headers(
            &two,
            false,
            Some("http://a.example"),
            &HeaderMap::new(),
            false,
        );
        assert_eq!(
            get(&out, "access-control-allow-origin"),
            ["http://a.example"]
        );
        assert_eq!(
            get(&out, "access-control-allow-credentials"),
            [] as [&str; 0]
        );
        // No Origin: no CORS request, only Vary.
        let out = cors_headers(&two, true, None, &HeaderMap::new(), false);
        assert_eq!(out.len(), 1);
    }

    #[test]
    fn any_and_localhost_modes() {
        let any = CorsOrigins::Any;
        let out = cors_headers(
            &any,
            true,
            Some("http://x.example"),
            &HeaderMap::new(),
            false,
        );
        assert_eq!(
            get(&out, "access-control-allow-origin"),
            ["http://x.example"]
        );
        assert_eq!(get(&out, "access-control-allow-credentials"), ["true"]);
        let out = cors_headers(
            &any,
            false,
            Some("http://x.example"),
            &HeaderMap::new(),
            false,
        );
        assert_eq!(get(&out, "access-control-allow-origin"), ["*"]);
        assert_eq!(
            get(&out, "access-control-allow-credentials"),
            [] as [&str; 0]
        );

        let local = listed("localhost");
        for ok in [
            "http://localhost:5173",
            "http://localhost",
            "https://127.0.0.1:8443",
            "http://[::1]:8080",
        ] {
            assert!(local.allows(ok), "{ok}");
        }
        for refused in [
            "http://evil.example",
            "http://localhost.evil.example",
            "http://127.0.0.2",
            "http://localhost:5173/",
            "ws://localhost:5173",
            "null",
        ] {
            assert!(!local.allows(refused), "{refused}");
        }
    }

    #[test]
    fn a_preflight_names_the_requested_headers_it_allows() {
        let two = listed("http://a.example,http://b.example");
        let request = headers(&[
            ("access-control-request-method", "POST"),
            (
                "access-control-request-headers",
                "Authorization,Content-Type, x-stainless-retry-count,X-Stainless-OS",
            ),
            ("access-control-request-headers", "anthropic-version"),
        ]);
        let out = cors_headers(&two, true, Some("http://b.example"), &request, true);
        assert_eq!(
            get(&out, "access-control-allow-origin"),
            ["http://b.example"]
        );
        assert_eq!(get(&out, "access-control-allow-credentials"), ["true"]);
        assert_eq!(
            get(&out, "access-control-allow-headers"),
            ["authorization, content-type, x-stainless-retry-count, x-stainless-os, anthropic-version"]
        );
        let methods = get(&out, "access-control-allow-methods");
        assert!(methods[0].contains("POST") && methods[0].contains("DELETE"));
        assert_eq!(get(&out, "access-control-max-age"), ["600"]);
        assert_eq!(
            get(&out, "vary"),
            [
                "Origin",
                "Access-Control-Request-Method, Access-Control-Request-Headers"
            ]
        );
        assert!(out.iter().all(|(_, v)| v != "*"));
        // A header nobody sends is left out, so the browser does not send the request.
        let odd = headers(&[
            ("access-control-request-method", "POST"),
            (
                "access-control-request-headers",
                "authorization, x-forwarded-for, x-stainless-",
            ),
        ]);
        let out = cors_headers(&two, true, Some("http://a.example"), &odd, true);
        assert_eq!(get(&out, "access-control-allow-headers"), ["authorization"]);
        // An unlisted origin's preflight gets nothing to go on.
        let out = cors_headers(&two, true, Some("http://c.example"), &request, true);
        assert!(out.iter().all(|(k, _)| k == header::VARY), "{out:?}");
        // Private Network Access is answered for an allowed origin only.
        let pna = headers(&[
            ("access-control-request-method", "GET"),
            ("access-control-request-private-network", "true"),
        ]);
        let out = cors_headers(&two, true, Some("http://a.example"), &pna, true);
        assert_eq!(get(&out, "access-control-allow-private-network"), ["true"]);
        let out = cors_headers(&two, true, Some("http://c.example"), &pna, true);
        assert_eq!(
            get(&out, "access-control-allow-private-network"),
            [] as [&str; 0]
        );
    }

    #[test]
    fn the_allowed_headers_cover_the_official_clients() {
        for h in [
            "authorization",
            "x-api-key",
            "content-type",
            "anthropic-version",
            "anthropic-beta",
            "anthropic-dangerous-direct-browser-access",
            "x-stainless-lang",
            "x-stainless-package-version",
            "x-stainless-os",
            "x-stainless-arch",
            "x-stainless-runtime",
            "x-stainless-runtime-version",
            "x-stainless-retry-count",
            "x-stainless-timeout",
            "x-stainless-helper-method",
            "openai-organization",
            "openai-project",
        ] {
            assert!(is_allowed_header(h), "{h}");
        }
        for h in [
            "cookie",
            "x-forwarded-for",
            "x-stainless-",
            "x-stainless-a b",
            "host",
        ] {
            assert!(!is_allowed_header(h), "{h}");
        }
    }
}
